"""The seed's script contract: a training script that reads `--pretrain_config_file`.

    python examples/train.py --pretrain_config_file examples/quickstart.yaml
    torchrun --nproc_per_node 1 examples/train.py --pretrain_config_file examples/quickstart.yaml
    accelerate launch --num_processes 1 --cpu examples/train.py --pretrain_config_file examples/quickstart.yaml

Extra `key=value` arguments after the file override config keys.
"""

from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.utils import parse_pretrain_args

cli = parse_pretrain_args()
pretrain_args = PreTrainingArguments.from_yaml(cli.pretrain_config_file, cli.overrides)
PreTrainer(pretrain_args=pretrain_args).train()
