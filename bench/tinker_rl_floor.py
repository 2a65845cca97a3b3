"""The floor under ``make tinker-rl``: how often the base model answers math_rl's arithmetic right. Prints JSON.

The cookbook's RL recipe (``math_rl env=arithmetic``) rewards a right sum. RL can only sharpen what
the policy already samples, so its start is the model's accuracy at the recipe's temperature, and
its reach is bounded by what greedy decoding finds. This measures both, without the service:
``transformers`` at fp32 decodes the recipe's own prompts (its few-shot prefix, rendered by the
recipe's renderer) and the recipe's own grader (``ArithmeticEnv.check_answer``) scores them, at
each ``--temperatures`` (0: greedy), ``--max-tokens`` reply tokens as the recipe allows.

    python bench/tinker_rl_floor.py [--model models/smollm2-135m] [--problems 60] [--temperatures 1.0 0.7 0.4 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"))
    parser.add_argument("--renderer", default="qwen3_instruct")  # make tinker-rl's
    parser.add_argument("--problems", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=5)  # the recipe's default
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.4, 0.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = get_tokenizer(args.model)
    renderer = renderers.get_renderer(args.renderer, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = np.random.RandomState(args.seed)
    problems = [
        (int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(args.problems)
    ]  # as the recipe draws
    stop = renderer.get_stop_sequences()
    result = {
        "bench": "tinker_rl_floor",
        "model": Path(args.model).name,
        "renderer": args.renderer,
        "problems": args.problems,
        "max_tokens": args.max_tokens,
        "accuracy": {},
    }
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    for temperature in args.temperatures:
        right = 0
        for x, y in problems:
            env = ArithmeticEnv(x, y, renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
            prompt = renderer.build_generation_prompt(
                env.convo_prefix + [{"role": "user", "content": env.get_question()}]
            )
            ids = torch.tensor([prompt.to_ints()])
            sampling = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature
                else {"do_sample": False}
            )
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=args.max_tokens, eos_token_id=stop, pad_token_id=stop[0], **sampling
                )
            message, _ = renderer.parse_response(out[0, ids.shape[1] :].tolist())
            right += env.check_answer(renderers.get_text_content(message))
        result["accuracy"][str(temperature)] = round(right / len(problems), 4)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
