"""Token-recording proxy overhead: the same multi-turn episodes through the proxy and direct. Prints JSON.

Both arms run against the same embedded engine behind the real sgl-router, in one run:

* **proxy**: each episode opens a session and posts its turns to it in the API ``--api`` names
  (Chat Completions, Responses or Anthropic Messages; raw HTTP by default, so the figure is the
  proxy's own cost; ``--client openai`` uses the SDK as an agent would); the proxy renders,
  bridges, records every token and builds the Sample at ``finish``.
* **direct**: each episode keeps its own token history client-side (the same ``ChatRenderer``:
  full render on turn 1, bridge after) and calls the router's ``/generate`` with ``input_ids``,
  which is what a hand-written TITO rollout does without a proxy.

Every call asks for exactly ``--tokens`` tokens with a per-episode seed (the session's
``sampling_params``, which hold for every API), so both arms do the same engine work.
``--concurrency`` episodes run at once (a closed loop). The arms alternate ``--rounds`` times; the
figure of merit is proxy / direct throughput (the machine's speed cancels out), with the added
per-call latency at p50 and p99 (proxy call latency minus direct).

    python bench/proxy_overhead.py                       # small model, 32 concurrent sessions
    python bench/proxy_overhead.py --api responses       # the same through /v1/responses (or messages)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from inverted.config import TinyModelConfig  # noqa: E402
from inverted.rollout.chat import ChatRenderer, Message  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402


SYSTEM = "You are a planning agent."


def user_turn(episode: int, turn: int) -> str:
    return f"Episode {episode}, step {turn}: what should we do next with item {episode * 7 + turn}?"


def chat_body(turns: list[tuple[str, str]], user: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for asked, answered in turns:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return {"model": "m", "messages": messages + [{"role": "user", "content": user}]}


def responses_body(turns: list[tuple[str, str]], user: str) -> dict:
    items = [item for asked, answered in turns
             for item in ({"role": "user", "content": asked}, {"role": "assistant", "content": answered})]
    return {"model": "m", "instructions": SYSTEM, "input": items + [{"role": "user", "content": user}]}


def messages_body(turns: list[tuple[str, str]], user: str) -> dict:
    body = chat_body(turns, user)
    return {"model": "m", "max_tokens": 1, "system": SYSTEM, "messages": body["messages"][1:]}  # the session sets max


# Each API: its route, the request for the conversation so far, the reply's text.
APIS = {
    "chat": ("/chat/completions", chat_body, lambda r: r["choices"][0]["message"]["content"]),
    "responses": ("/responses", responses_body, lambda r: "".join(
        part["text"] for item in r["output"] if item["type"] == "message" for part in item["content"])),
    "messages": ("/messages", messages_body, lambda r: "".join(b["text"] for b in r["content"] if b["type"] == "text")),
}


async def proxy_episode(proxy_url: str, http: httpx.AsyncClient, episode: int, args, latencies: list[float]) -> int:
    # The session fixes each call's length and seed, whatever the API can express.
    sampling = {"max_tokens": args.tokens, "min_tokens": args.tokens, "seed": episode}
    session = (await http.post(proxy_url + "/sessions", json={"sample": {"index": episode},
                                                              "sampling_params": sampling})).json()
    route, body_of, text_of = APIS[args.api]
    sdk = openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0) if args.client == "openai" else None
    turns: list[tuple[str, str]] = []
    for turn in range(args.turns):
        user = user_turn(episode, turn)
        body = body_of(turns, user)
        started = time.perf_counter()
        if sdk is not None:
            reply = (await sdk.chat.completions.create(**body)).model_dump()
        else:
            reply = (await http.post(session["base_url"] + route, json=body)).json()
        latencies.append(time.perf_counter() - started)
        turns.append((user, text_of(reply)))
    if sdk is not None:
        await sdk.close()
    samples = (await http.post(f"{proxy_url}/sessions/{session['session_id']}/finish")).json()["samples"]
    return sum(sum(s["loss_mask"]) for s in samples)


async def direct_episode(router_url: str, http: httpx.AsyncClient, renderer: ChatRenderer, episode: int, args,
                         latencies: list[float]) -> int:
    history = [Message(role="system", content=SYSTEM)]
    tokens: list[int] = []
    sampled: list[int] = []
    produced = 0
    for turn in range(args.turns):
        new = [Message(role="user", content=user_turn(episode, turn))]
        started = time.perf_counter()
        tokens += renderer.prompt_ids(history + new, None) if not tokens else renderer.bridge(history, new, None, sampled)
        body = {"input_ids": tokens, "return_logprob": True,
                "sampling_params": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens,
                                    "sampling_seed": episode}}
        out = (await http.post(router_url + "/generate", json=body)).json()
        latencies.append(time.perf_counter() - started)
        sampled = out["output_ids"]
        tokens += sampled
        produced += len(sampled)
        text = renderer.tokenizer.decode(sampled, skip_special_tokens=True)
        history += new + [Message(role="assistant", content=text)]
    return produced


async def run_arm(name: str, urls: dict[str, str], renderer: ChatRenderer, args) -> dict[str, float]:
    latencies: list[float] = []
    queue = list(range(args.episodes))
    produced = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as http:
        async def worker() -> None:
            nonlocal produced
            while queue:
                episode = queue.pop()
                if name == "proxy":
                    tokens = await proxy_episode(urls["proxy"], http, episode, args, latencies)
                else:
                    tokens = await direct_episode(urls["router"], http, renderer, episode, args, latencies)
                produced += tokens  # after the await: `produced += await ...` would read a stale total

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {"tokens_per_s": produced / elapsed, "tokens": produced, "elapsed_s": elapsed, "calls": len(latencies),
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[int(len(latencies) * 0.99)]}


def start_stack(model: Path, log_dir: Path, *, engine_args: tuple[str, ...] = (),
                proxy_args: tuple[str, ...] = ()) -> dict[str, ManagedProcess]:
    """An embedded engine, the real sgl-router in front of it and a proxy in front of that."""
    py = sys.executable
    ports = {name: free_port() for name in ("engine", "router", "proxy")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    engine = ManagedProcess.spawn("engine", [py, "-m", "inverted.cli", "serve-engine", "--model", str(model), "--port",
                                             str(ports["engine"]), *engine_args],
                                  log_dir / "engine.log", url["engine"])
    engine.wait_healthy(180)
    router = ManagedProcess.spawn("router", [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                                             str(ports["router"]), "--prometheus-port", str(free_port()),
                                             "--worker-urls", engine.url, "--log-level", "warn"],
                                  log_dir / "router.log", url["router"])
    router.wait_healthy(60, "/readiness")
    proxy = ManagedProcess.spawn("proxy", [py, "-m", "inverted.cli", "proxy", "--router-url", router.url,
                                           "--tokenizer", str(model), "--proxy-port", str(ports["proxy"]), *proxy_args],
                                 log_dir / "proxy.log", url["proxy"])
    proxy.wait_healthy(60)
    return {"engine": engine, "router": router, "proxy": proxy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/small-qwen2", help="checkpoint (made if missing)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="tokens sampled per call")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads (the rest is for the proxy)")
    parser.add_argument("--api", default="chat", choices=sorted(APIS), help="the API the proxy arm speaks")
    parser.add_argument("--client", default="httpx", choices=["httpx", "openai"],
                        help="how the proxy arm calls it: raw HTTP (the proxy's own cost) or the openai SDK (chat)")
    parser.add_argument("--log-dir", default="runs/bench-proxy")
    args = parser.parse_args()
    if args.client == "openai" and args.api != "chat":
        parser.error("--client openai drives the chat API only")
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset=args.preset))
    procs = start_stack(model, Path(args.log_dir), engine_args=("--num-threads", str(args.threads)))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
    urls = {name: proc.url for name, proc in procs.items()}
    try:
        runs: dict[str, list[dict]] = {"direct": [], "proxy": []}
        asyncio.run(run_arm("direct", urls, renderer, argparse.Namespace(**{**vars(args), "episodes": 8})))  # warm-up
        for _ in range(args.rounds):
            for arm in ("direct", "proxy"):
                runs[arm].append(asyncio.run(run_arm(arm, urls, renderer, args)))
    finally:
        for proc in procs.values():
            proc.terminate()
    best = {arm: max(r["tokens_per_s"] for r in results) for arm, results in runs.items()}
    p50 = {arm: statistics.median(r["p50_s"] for r in results) for arm, results in runs.items()}
    p99 = {arm: statistics.median(r["p99_s"] for r in results) for arm, results in runs.items()}
    print(json.dumps({
        "model": str(model), "api": args.api, "concurrency": args.concurrency, "episodes": args.episodes, "turns": args.turns,
        "tokens_per_call": args.tokens, "runs": runs,
        "direct_tokens_per_s": round(best["direct"], 1), "proxy_tokens_per_s": round(best["proxy"], 1),
        "ratio_proxy_over_direct": round(best["proxy"] / best["direct"], 3), "target_ratio": 0.9,
        "added_latency_p50_ms": round((p50["proxy"] - p50["direct"]) * 1000, 1),
        "added_latency_p99_ms": round((p99["proxy"] - p99["direct"]) * 1000, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
