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
    python bench/proxy_overhead.py --session-turns 200 --tokens 16   # one long session: linear?

With ``--harness claude`` (or ``codex``), the request is the harness's own first one, captured from
its real process (``make harnesses``) by a stand-in endpoint that answers nothing: Claude Code's
system prompt and tools run to ~29,000 tokens of the tiny tokenizer (Codex's to ~31,000). It is sent
``--rounds`` times, each in a fresh session (a full render and tokenization every time), against a
direct ``/generate`` of the same ids, alternating, on a tiny model with a 64k context; each call
samples ``--tokens`` tokens. Both arms find the prompt in the engine's prefix cache after the first
call, so the difference is the proxy's own work: reading the body, rendering, tokenizing, recording.

With ``--session-turns 200`` it measures whether a long session stays linear. One session of 200 turns
with tool calls runs through the proxy at concurrency 1 on the 64k tiny model: each turn sends the whole
history with ``tools``, and the reply comes back as a call of ``lookup`` (a random model writes no
calls, so ``--proxy-tool-parser-path`` here reads each reply as one, with the reply as its argument),
answered by a tool message. Then the engine's cache is flushed and the same prompts go to ``/generate``
directly, in order, each finding the previous one's prefix cached as the proxy's did: a turn's
**overhead** is the proxy's wall time minus the direct call's (median over ``--rounds``). The API is
stateless, so every turn resends the whole history: each turn's body is also sent with a field the proxy
refuses before it reads the messages, which is what receiving and decoding the resent history costs (the
**reading floor**), and the overhead beyond it is the proxy's own work (placing, parsing, rendering,
bridging, tokenizing, recording). Then 8 such sessions run at once, and each later turn's
``cached_tokens`` (the engine's prefix reuse, as the proxy reports it in ``usage``) is compared with the
history it resent (the previous turn's prompt and reply).
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
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.rollout.chat import ChatRenderer, Message, ParsedReply, ToolCall, new_call_id  # noqa: E402
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
    items = [
        item
        for asked, answered in turns
        for item in ({"role": "user", "content": asked}, {"role": "assistant", "content": answered})
    ]
    return {"model": "m", "instructions": SYSTEM, "input": items + [{"role": "user", "content": user}]}


def messages_body(turns: list[tuple[str, str]], user: str) -> dict:
    body = chat_body(turns, user)
    return {"model": "m", "max_tokens": 1, "system": SYSTEM, "messages": body["messages"][1:]}  # the session sets max


# Each API: its route, the request for the conversation so far, the reply's text.
APIS = {
    "chat": ("/chat/completions", chat_body, lambda r: r["choices"][0]["message"]["content"]),
    "responses": (
        "/responses",
        responses_body,
        lambda r: "".join(
            part["text"] for item in r["output"] if item["type"] == "message" for part in item["content"]
        ),
    ),
    "messages": ("/messages", messages_body, lambda r: "".join(b["text"] for b in r["content"] if b["type"] == "text")),
}


async def proxy_episode(proxy_url: str, http: httpx.AsyncClient, episode: int, args, latencies: list[float]) -> int:
    # The session fixes each call's length and seed, whatever the API can express.
    sampling = {"max_tokens": args.tokens, "min_tokens": args.tokens, "seed": episode}
    session = (
        await http.post(proxy_url + "/sessions", json={"sample": {"index": episode}, "sampling_params": sampling})
    ).json()
    route, body_of, text_of = APIS[args.api]
    sdk = (
        openai.AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        if args.client == "openai"
        else None
    )
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


async def direct_episode(
    router_url: str, http: httpx.AsyncClient, renderer: ChatRenderer, episode: int, args, latencies: list[float]
) -> int:
    history = [Message(role="system", content=SYSTEM)]
    tokens: list[int] = []
    sampled: list[int] = []
    produced = 0
    for turn in range(args.turns):
        new = [Message(role="user", content=user_turn(episode, turn))]
        started = time.perf_counter()
        tokens += (
            renderer.prompt_ids(history + new, None) if not tokens else renderer.bridge(history, new, None, sampled)
        )
        body = {
            "input_ids": tokens,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "sampling_seed": episode},
        }
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
    return {
        "tokens_per_s": produced / elapsed,
        "tokens": produced,
        "elapsed_s": elapsed,
        "calls": len(latencies),
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[int(len(latencies) * 0.99)],
    }


def start_stack(
    model: Path, log_dir: Path, *, engine_args: tuple[str, ...] = (), proxy_args: tuple[str, ...] = ()
) -> dict[str, ManagedProcess]:
    """An embedded engine, the real sgl-router in front of it and a proxy in front of that."""
    py = sys.executable
    ports = {name: free_port() for name in ("engine", "router", "proxy")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    engine = ManagedProcess.spawn(
        "engine",
        [py, "-m", "inverted.cli", "serve-engine", "--model", str(model), "--port", str(ports["engine"]), *engine_args],
        log_dir / "engine.log",
        url["engine"],
    )
    engine.wait_healthy(180)
    router = ManagedProcess.spawn(
        "router",
        [
            py,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["router"]),
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            engine.url,
            "--log-level",
            "warn",
        ],
        log_dir / "router.log",
        url["router"],
    )
    router.wait_healthy(60, "/readiness")
    proxy = ManagedProcess.spawn(
        "proxy",
        [
            py,
            "-m",
            "inverted.cli",
            "proxy",
            "--router-url",
            router.url,
            "--tokenizer",
            str(model),
            "--proxy-port",
            str(ports["proxy"]),
            *proxy_args,
        ],
        log_dir / "proxy.log",
        url["proxy"],
    )
    proxy.wait_healthy(60)
    return {"engine": engine, "router": router, "proxy": proxy}


# ---- one harness request ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = {  # name: (its binary, its command line, the API route its first call takes)
    "claude": ("claude", ["-p", "List the files here."], "/messages"),
    "codex": (
        "codex",
        ["exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", "List the files here."],
        "/responses",
    ),
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
        env = {
            "PATH": os.environ["PATH"],
            "HOME": home,
            "CODEX_HOME": home,
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "x",
            "INVERTED_KEY": "x",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        Path(home, "config.toml").write_text(
            f'model_provider = "bench"\n[model_providers.bench]\nname = "bench"\n'
            f'base_url = "{url}/v1"\nenv_key = "INVERTED_KEY"\n'
        )
        path = ROOT / ".harnesses" / "node_modules" / ".bin" / binary
        if not path.exists():
            raise SystemExit(f"{path} is missing: make harnesses")
        subprocess.run(
            [str(path), *argv], cwd=home, env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL
        )
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
            ids = sample["tokens"][: len(sample["tokens"]) - sample["response_length"]]
            started = time.perf_counter()
            direct = await http.post(
                urls["router"] + "/generate",
                json={
                    "input_ids": ids,
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "temperature": 0},
                },
            )
            direct_took = time.perf_counter() - started
            assert direct.status_code == 200, direct.text[:500]
            if round_:
                latency["proxy"].append(took)
                latency["direct"].append(direct_took)
    p50 = {arm: statistics.median(values) for arm, values in latency.items()}
    return {
        "prompt_tokens": len(ids),
        "request_bytes": len(json.dumps(body)),
        "rounds": args.rounds,
        "proxy_p50_ms": round(p50["proxy"] * 1000, 1),
        "direct_p50_ms": round(p50["direct"] * 1000, 1),
        "overhead_p50_ms": round((p50["proxy"] - p50["direct"]) * 1000, 1),
        "ratio_proxy_over_direct_latency": round(p50["proxy"] / p50["direct"], 3),
    }


def harness_overhead(args) -> None:
    body = capture_first_request(args.harness)
    model = Path(args.model if args.model != "models/small-qwen2" else "models/tiny-qwen2-64k")
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="tiny", max_positions=65536))
    context = ("--context-length", "65536")
    procs = start_stack(
        model, Path(args.log_dir), engine_args=("--num-threads", str(args.threads), *context), proxy_args=context
    )
    try:
        report = asyncio.run(
            harness_rounds({name: p.url for name, p in procs.items()}, body, HARNESSES[args.harness][2], args)
        )
    finally:
        for proc in procs.values():
            proc.terminate()
    print(
        json.dumps({"harness": args.harness, "model": str(model), "tokens_per_call": args.tokens, **report}, indent=2)
    )


# ---- one long session -------------------------------------------------------------------------

LOOKUP = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a note up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


class EveryReplyCalls:
    """A ``--proxy-tool-parser-path`` plug-in for this bench: every reply is one call of ``lookup``."""

    start = "\x00"  # nothing to hold back: this bench does not stream

    def parse(self, text: str) -> ParsedReply:
        return ParsedReply(content=None, tool_calls=[ToolCall(new_call_id(), "lookup", json.dumps({"q": text}))])


async def long_session(http: httpx.AsyncClient, proxy_url: str, episode: int, args) -> tuple[list[float], dict, list]:
    """One session of ``--session-turns`` tool-calling turns: each turn's latency, its Sample, and
    each turn's request body."""
    sampling = {"max_tokens": args.tokens, "min_tokens": args.tokens, "temperature": 0}
    session = (await http.post(proxy_url + "/sessions", json={"sampling_params": sampling})).json()
    messages = [
        {"role": "system", "content": f"You are agent {episode}. Look notes up until you are done."},
        {"role": "user", "content": f"Find everything on item {episode}."},
    ]
    latencies, bodies = [], []
    for turn in range(args.session_turns):
        bodies.append({"model": "m", "messages": list(messages), "tools": LOOKUP})
        started = time.perf_counter()
        reply = await http.post(session["base_url"] + "/chat/completions", json=bodies[-1])
        latencies.append(time.perf_counter() - started)
        assert reply.status_code == 200, reply.text[:500]
        message = reply.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        messages += [
            {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"note {turn}: item {episode} is fine."},
        ]
    (sample,) = (await http.post(f"{proxy_url}/sessions/{session['session_id']}/finish")).json()["samples"]
    return latencies, sample, bodies


async def reading_floor(http: httpx.AsyncClient, proxy_url: str, bodies: list[dict]) -> list[float]:
    """Each turn's body sent to the proxy with a field it refuses before reading the messages: what
    sending, receiving and decoding the resent history costs, the least any proxy of this stateless
    API pays per turn."""
    session = (await http.post(proxy_url + "/sessions", json={})).json()
    latencies = []
    for body in bodies:
        started = time.perf_counter()
        refused = await http.post(session["base_url"] + "/chat/completions", json={**body, "bench_floor": 1})
        latencies.append(time.perf_counter() - started)
        assert refused.status_code == 400, refused.text[:300]
    return latencies


async def direct_replay(http: httpx.AsyncClient, router_url: str, sample: dict, args) -> tuple[list[float], int]:
    """The session's prompts straight to ``/generate``, in order: each turn's latency, and how many
    turns sampled other tokens than the proxy recorded (greedy on both sides: 0 expected)."""
    latencies, differ = [], 0
    for turn in sample["metadata"]["turns"]:
        started = time.perf_counter()
        out = (
            await http.post(
                router_url + "/generate",
                json={
                    "input_ids": sample["tokens"][: turn["start"]],
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "temperature": 0},
                },
            )
        ).json()
        latencies.append(time.perf_counter() - started)
        differ += out["output_ids"] != sample["tokens"][turn["start"] : turn["end"]]
    return latencies, differ


def reuse(sample: dict) -> list[float]:
    """Each later turn's ``cached_tokens`` over the history it resent (the previous turn's prompt and reply)."""
    turns = sample["metadata"]["turns"]
    return [turn["cached_tokens"] / before["end"] for before, turn in zip(turns, turns[1:])]


async def session_rounds(urls: dict[str, str], args) -> dict:
    overheads: list[list[float]] = []
    floors: list[list[float]] = []
    differ = 0
    async with httpx.AsyncClient(timeout=600) as http:
        await long_session(http, urls["proxy"], -1, argparse.Namespace(**{**vars(args), "session_turns": 8}))  # warm-up
        for round_ in range(args.rounds):
            assert (await http.post(urls["engine"] + "/flush_cache")).status_code == 200  # both passes start cold
            proxy, sample, bodies = await long_session(http, urls["proxy"], round_, args)
            assert (await http.post(urls["engine"] + "/flush_cache")).status_code == 200
            direct, differs = await direct_replay(http, urls["router"], sample, args)
            differ += differs
            overheads.append([p - d for p, d in zip(proxy, direct)])
            floors.append(await reading_floor(http, urls["proxy"], bodies))
        concurrent = await asyncio.gather(
            *(long_session(http, urls["proxy"], 100 + i, args) for i in range(args.sessions))
        )
    per_turn = [statistics.median(values) for values in zip(*overheads)]
    floor = [statistics.median(values) for values in zip(*floors)]
    own = [o - f for o, f in zip(per_turn, floor)]  # the proxy's work beyond reading the request
    shares = [share for _, sample, _ in concurrent for share in reuse(sample)] or [float("nan")]
    early, late = statistics.median(per_turn[:10]), statistics.median(per_turn[-10:])
    own_early, own_late = statistics.median(own[:10]), statistics.median(own[-10:])
    return {
        "turns": args.session_turns,
        "rounds": args.rounds,
        "prompt_tokens_last_turn": sample["metadata"]["turns"][-1]["start"],
        "replies_differing_from_the_record": differ,
        "overhead_ms_turn_1": round(per_turn[0] * 1000, 2),
        f"overhead_ms_turn_{args.session_turns}": round(per_turn[-1] * 1000, 2),
        "overhead_ms_turns_1_10_p50": round(early * 1000, 2),
        f"overhead_ms_turns_{args.session_turns - 9}_{args.session_turns}_p50": round(late * 1000, 2),
        "ratio_last_10_over_first_10": round(late / early, 3),
        "target_ratio": 1.5,
        "reading_floor_ms_turns_1_10_p50": round(statistics.median(floor[:10]) * 1000, 2),
        f"reading_floor_ms_turns_{args.session_turns - 9}_{args.session_turns}_p50": round(
            statistics.median(floor[-10:]) * 1000, 2
        ),
        "beyond_floor_ms_turns_1_10_p50": round(own_early * 1000, 2),
        f"beyond_floor_ms_turns_{args.session_turns - 9}_{args.session_turns}_p50": round(own_late * 1000, 2),
        "beyond_floor_ratio_last_10_over_first_10": round(own_late / own_early, 3),
        "overhead_ms_per_turn": [round(o * 1000, 2) for o in per_turn],
        "sessions_at_once": args.sessions,
        "cached_share_of_history_mean": round(statistics.mean(shares), 4),
        "cached_share_of_history_min": round(min(shares), 4),
        "target_cached_share": 0.95,
        "later_turns_at_target": round(sum(share >= 0.95 for share in shares) / len(shares), 4),
    }


def session_overhead(args) -> None:
    model = Path(args.model if args.model != "models/small-qwen2" else "models/tiny-qwen2-64k")
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="tiny", max_positions=65536))
    context = ("--context-length", "65536")
    procs = start_stack(
        model,
        Path(args.log_dir),
        engine_args=("--num-threads", str(args.threads), *context),
        proxy_args=(*context, "--proxy-tool-parser-path", "bench.proxy_overhead:EveryReplyCalls"),
    )
    try:
        report = asyncio.run(session_rounds({name: p.url for name, p in procs.items()}, args))
    finally:
        for proc in procs.values():
            proc.terminate()
    print(json.dumps({"model": str(model), "tokens_per_call": args.tokens, **report}, indent=2))


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
    parser.add_argument(
        "--client",
        default="httpx",
        choices=["httpx", "openai"],
        help="how the proxy arm calls it: raw HTTP (the proxy's own cost) or the openai SDK (chat)",
    )
    parser.add_argument("--log-dir", default="runs/bench-proxy")
    parser.add_argument(
        "--harness",
        choices=sorted(HARNESSES),
        help="measure one coding harness's real first request instead (see above)",
    )
    parser.add_argument(
        "--session-turns",
        type=int,
        default=0,
        help="measure one session of this many tool-calling turns instead (see above)",
    )
    parser.add_argument(
        "--sessions", type=int, default=8, help="with --session-turns: sessions at once for the prefix-reuse figure"
    )
    args = parser.parse_args()
    if args.harness:
        return harness_overhead(args)
    if args.session_turns:
        return session_overhead(args)
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
    print(
        json.dumps(
            {
                "model": str(model),
                "api": args.api,
                "concurrency": args.concurrency,
                "episodes": args.episodes,
                "turns": args.turns,
                "tokens_per_call": args.tokens,
                "runs": runs,
                "direct_tokens_per_s": round(best["direct"], 1),
                "proxy_tokens_per_s": round(best["proxy"], 1),
                "ratio_proxy_over_direct": round(best["proxy"] / best["direct"], 3),
                "target_ratio": 0.9,
                "added_latency_p50_ms": round((p50["proxy"] - p50["direct"]) * 1000, 1),
                "added_latency_p99_ms": round((p99["proxy"] - p99["direct"]) * 1000, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
