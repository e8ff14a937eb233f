"""The mixture recipe of docs/data.md on the quickstart model: two languages, and a small instruction set
annealed in the last stage, against the same run without the annealing stage.

Sources (all in examples/data): `en`, the CPython documentation pages; `zh`, the Chinese reviews; `hq`, the
alpaca records on Python topics. `annealed`: en 0.7 / zh 0.3 for the first 80% of the tokens, then en 0.4 /
zh 0.2 / hq 0.4; `flat`: en 0.7 / zh 0.3 throughout. Both train the quickstart's 240 steps (fp32, same seed)
and evaluate each source's held-out 5%. Prints the final eval loss per source and the draws plan.

    .venv/bin/python bench/mixture_recipe.py [--steps 240] [--work runs/mixture-recipe]
"""

from __future__ import annotations

import argparse
import shutil

from common import REPO, metrics, pretrainer

SOURCES = {"en": "examples/data/python_docs.jsonl", "zh": "examples/data/zh_reviews.txt",
           "hq": "examples/data/python_topics_alpaca.json"}
TOKENS_PER_STEP = 8 * 256


def sources() -> str:
    return "train_data=[" + ", ".join(f"{{name: {name}, path: {path}}}" for name, path in SOURCES.items()) + "]"


def schedule(steps: int, annealed: bool) -> str:
    main = "{weights: {en: 0.7, zh: 0.3}}"
    if not annealed:
        return f"mixture_schedule=[{main}]"
    until = int(0.8 * steps) * TOKENS_PER_STEP
    return (f"mixture_schedule=[{{until_tokens: {until}, weights: {{en: 0.7, zh: 0.3}}}}, "
            "{weights: {en: 0.4, zh: 0.2, hq: 0.4}}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--work", default="runs/mixture-recipe")
    ns = parser.parse_args()
    work = REPO / ns.work
    shutil.rmtree(work, ignore_errors=True)
    finals = {}
    for name in ("annealed", "flat"):
        pretrainer("train", "examples/quickstart.yaml", sources(), schedule(ns.steps, name == "annealed"),
                   f"num_training_steps={ns.steps}", "downstream_evals=null", "export_hf=false",
                   "log_interval=40", f"eval_interval={ns.steps}", f"save_dir={work / name}")
        evals = [row for row in metrics(work / name) if "eval_loss" in row]
        finals[name] = evals[-1]
        tokens = [row for row in metrics(work / name) if "loss" in row][-1]
        finals[name]["tokens"] = {s: tokens.get(f"source_tokens/{s}", 0) for s in SOURCES}
    print(f"{'run':<10} " + " ".join(f"{'eval ' + s:>10}" for s in SOURCES) + f" {'eval (all)':>10}   tokens "
          + " / ".join(SOURCES))
    for name, row in finals.items():
        print(f"{name:<10} " + " ".join(f"{row.get(f'eval_loss/{s}', float('nan')):>10.4f}" for s in SOURCES)
              + f" {row['eval_loss']:>10.4f}   " + " / ".join(f"{row['tokens'][s]:,}" for s in SOURCES))


if __name__ == "__main__":
    main()
