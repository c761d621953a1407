"""`kvserve generate` (stream text to the terminal) and `kvserve bench throughput`."""
from __future__ import annotations

import argparse
import json
import sys

from kvserve.config import EngineConfig


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    EngineConfig.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the model's chat template")
    gen.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on a random mixed workload")
    EngineConfig.add_cli_args(tp)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.set_defaults(func=bench_throughput)
    from kvserve.bench import serve as bench_serve
    bench_serve.register(bench_sub)


def generate(args: argparse.Namespace) -> int:
    from kvserve import LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig.from_cli_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    prompt = args.prompt
    if args.chat:
        from kvserve.frontend.chat_template import ChatRenderer

        if engine.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer: drop --chat or pass another --model.")
        renderer = ChatRenderer(engine.tokenizer)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        text = renderer.render(messages, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": renderer.encode(text)}
    elif args.system:
        raise ValueError("--system only applies with --chat: add --chat or drop --system.")
    engine.add_request("cli", prompt, params)
    shown, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if not args.json:
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
            shown, final = text, out
    c, m = final.outputs[0], final.metrics
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_token_ids": final.prompt_token_ids,
                          "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                          "metrics": {"ttft_s": m.ttft, "tpot_s": m.tpot, "e2e_s": m.e2e,
                                      "itl_s": m.itl}}))
    else:
        print(flush=True)
        tpot = f"{m.tpot * 1e3:.2f} ms" if m.tpot else "n/a"
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}, TTFT {m.ttft * 1e3:.1f} ms, "
              f"TPOT {tpot}]", file=sys.stderr)
    return 0


def bench_throughput(args: argparse.Namespace) -> int:
    from kvserve import LLMEngine
    from kvserve.bench.throughput import mixed_workload, run_engine

    engine = LLMEngine(EngineConfig.from_cli_args(args))
    work = mixed_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                          engine.model_config.vocab_size, args.workload_seed)
    r = run_engine(engine, work)
    print(f"requests {r.num_requests}  prompt tokens {r.prompt_tokens}  output tokens {r.output_tokens}")
    print(f"elapsed {r.elapsed_s:.2f} s  output {r.output_tok_per_s:.1f} tok/s  steps {r.steps}  "
          f"engine overhead {100 * r.overhead_share:.1f}% of step time")
    return 0
