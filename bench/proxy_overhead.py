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
    python bench/proxy_overhead.py --harness claude      # one coding harness's real first request

With ``--harness claude`` (or ``codex``), the request is the harness's own first one, captured from
its real process (``make harnesses``) by a stand-in endpoint that answers nothing: Claude Code's
system prompt and tools run to ~29,000 tokens of the tiny tokenizer (Codex's to ~31,000). It is sent
``--rounds`` times, each in a fresh session (a full render and tokenization every time), against a
direct ``/generate`` of the same ids, alternating, on a tiny model with a 64k context; each call
samples ``--tokens`` tokens. Both arms find the prompt in the engine's prefix cache after the first
call, so the difference is the proxy's own work: reading the body, rendering, tokenizing, recording.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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


# ---- one harness request ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = {  # name: (its binary, its command line, the API route its first call takes)
    "claude": ("claude", ["-p", "List the files here."], "/messages"),
    "codex": ("codex", ["exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", "List the files here."],
              "/responses"),
}


def capture_first_request(name: str) -> dict:
    """The harness's first model request, as its real process sends it to an endpoint that refuses it."""
    seen: list[dict] = []

    class Stand(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "error", "error": {"type": "invalid_request_error", "message": "captured"}}')

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stand)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    binary, argv, _ = HARNESSES[name]
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory() as home:
        env = {"PATH": os.environ["PATH"], "HOME": home, "CODEX_HOME": home, "ANTHROPIC_BASE_URL": url,
               "ANTHROPIC_API_KEY": "x", "INVERTED_KEY": "x", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        Path(home, "config.toml").write_text(f'model_provider = "bench"\n[model_providers.bench]\nname = "bench"\n'
                                             f'base_url = "{url}/v1"\nenv_key = "INVERTED_KEY"\n')
        path = ROOT / ".harnesses" / "node_modules" / ".bin" / binary
        if not path.exists():
            raise SystemExit(f"{path} is missing: make harnesses")
        subprocess.run([str(path), *argv], cwd=home, env=env, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    server.shutdown()
    if not seen:
        raise SystemExit(f"{name} sent no request")
    return seen[0]


async def harness_rounds(urls: dict[str, str], body: dict, route: str, args) -> dict:
    sampling = {"max_tokens": args.tokens, "min_tokens": args.tokens, "temperature": 0}
    latency: dict[str, list[float]] = {"proxy": [], "direct": []}
    ids: list[int] = []
    async with httpx.AsyncClient(timeout=600) as http:
        for round_ in range(args.rounds + 1):  # the first round warms the prefix cache: not counted
            session = (await http.post(urls["proxy"] + "/sessions", json={"sampling_params": sampling})).json()
            started = time.perf_counter()
            answer = await http.post(session["base_url"] + route, json={**body, "stream": False})
            took = time.perf_counter() - started
            assert answer.status_code == 200, answer.text[:500]
            (sample,) = (await http.post(f"{urls['proxy']}/sessions/{session['session_id']}/finish")).json()["samples"]
            ids = sample["tokens"][:len(sample["tokens"]) - sample["response_length"]]
            started = time.perf_counter()
            direct = await http.post(urls["router"] + "/generate", json={
                "input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "temperature": 0}})
            direct_took = time.perf_counter() - started
            assert direct.status_code == 200, direct.text[:500]
            if round_:
                latency["proxy"].append(took)
                latency["direct"].append(direct_took)
    p50 = {arm: statistics.median(values) for arm, values in latency.items()}
    return {"prompt_tokens": len(ids), "request_bytes": len(json.dumps(body)), "rounds": args.rounds,
            "proxy_p50_ms": round(p50["proxy"] * 1000, 1), "direct_p50_ms": round(p50["direct"] * 1000, 1),
            "overhead_p50_ms": round((p50["proxy"] - p50["direct"]) * 1000, 1),
            "ratio_proxy_over_direct_latency": round(p50["proxy"] / p50["direct"], 3)}


def harness_overhead(args) -> None:
    body = capture_first_request(args.harness)
    model = Path(args.model if args.model != "models/small-qwen2" else "models/tiny-qwen2-64k")
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="tiny", max_positions=65536))
    context = ("--context-length", "65536")
    procs = start_stack(model, Path(args.log_dir), engine_args=("--num-threads", str(args.threads), *context),
                        proxy_args=context)
    try:
        report = asyncio.run(harness_rounds({name: p.url for name, p in procs.items()}, body,
                                            HARNESSES[args.harness][2], args))
    finally:
        for proc in procs.values():
            proc.terminate()
    print(json.dumps({"harness": args.harness, "model": str(model), "tokens_per_call": args.tokens, **report},
                     indent=2))


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
    parser.add_argument("--harness", choices=sorted(HARNESSES),
                        help="measure one coding harness's real first request instead (see above)")
    args = parser.parse_args()
    if args.harness:
        return harness_overhead(args)
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
