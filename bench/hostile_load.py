"""What a hostile request costs everyone else: ``/health`` latency while a service refuses it. Prints JSON.

One embedded engine behind the real sgl-router and a proxy in front, default flags (tiny model):

* **idle**: ``/health`` latency with nothing else running (the baseline of the same run);
* **engine_text**: while ``/generate`` is sent a ``--text-mb`` MB text, again and again (refused by its
  length before it is tokenized; before that bound it held the engine two minutes);
* **proxy_text**: while a session is sent a ``--text-mb`` MB chat message (refused by its length;
  before, 29.5 s of tokenizing on the event loop);
* **engine_body** / **proxy_body**: while each is sent ``--body-mb`` MB bodies, over its body limit
  (413 from the declared length, unread);
* **sessions**: the proxy's RSS empty, then holding ``--max-sessions`` sessions (the cap), then after
  as many again were refused with 429;
* **engine_grammar**: while ``/generate`` is sent a 337 kB ``json_schema`` with ``n=16``, again and
  again (the audit's: 16 compiles on the event loop per request before; now one, on a worker
  thread, and kept);
* **engine_payload**: while ``/update_weights_from_tensor`` is sent a 40-byte pickle asking for a
  1 GiB ``bytearray`` (allocated before any check before; refused unallocated now), with the
  engine's peak RSS before and after;
* **engine_n**: while ``/generate`` is asked for ``n=100000`` samples of one prompt, 100 bytes (the
  audit: through the job's router, a training step of 0.9 s took 28.4 s; now a 400 before any runs);
* **slow_clients**: while ``--slow-clients`` connections to the engine hold a request's headers
  unfinished (never closed by the server before; now after ``HEADERS_TIMEOUT_S``), and how many of
  them the engine had closed by the end of the arm.

The figure of merit is each arm's p99 ``/health`` latency over the idle one (a ratio: the machine's
speed cancels out), with the refusals' own latency beside it.

    python bench/hostile_load.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy_overhead import start_stack  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.processes import ManagedProcess  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402


def attack(url: str, body: bytes, stop, results) -> None:
    """In its own process (so that the probe's latency is the server's, not this client's GIL):
    post ``body`` again and again until ``stop``; report (seconds, status) of each."""
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                status = http.post(url, content=body, headers={"content-type": "application/json"}).status_code
            except httpx.TransportError:  # answered 413 and closed before the whole body was sent
                status = 413
            results.put((time.perf_counter() - started, status))


def health_while(url: str, seconds: float, target: str | None = None, body: bytes = b"") -> dict[str, float]:
    """``/health`` latencies for ``seconds``, alone or while another process posts ``body`` to ``target``."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    attacker = context.Process(target=attack, args=(target, body, stop, results), daemon=True) if target else None
    if attacker:
        attacker.start()
        time.sleep(1.0)  # the attacker's interpreter starting is not the server's cost
    latencies = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            http.get(url + "/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    stop.set()
    refusals = []
    if attacker:  # drained while it ends: a child with unread results in its queue cannot exit
        deadline = time.monotonic() + 300
        while attacker.is_alive() and time.monotonic() < deadline:
            try:
                refusals.append(results.get(timeout=0.1))
            except queue.Empty:
                pass
        while not results.empty():
            refusals.append(results.get())
    latencies.sort()
    out = {
        "health_p50_ms": 1e3 * statistics.median(latencies),
        "health_p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)],
        "health_max_ms": 1e3 * latencies[-1],
        "probes": len(latencies),
    }
    if refusals:
        out |= {
            "refusals": len(refusals),
            "statuses": sorted({s for _, s in refusals}),
            "refusal_median_s": statistics.median(t for t, _ in refusals),
        }
    return out


def grammar_body() -> bytes:
    """A 337 kB JSON schema (~0.6 s to compile on 2 cores), asked for 16 times in one request."""
    properties = {
        f"field_{i}": {
            "type": "object",
            "properties": {f"x{j}": {"enum": [f"v{k}" for k in range(8)]} for j in range(12)},
        }
        for i in range(400)
    }
    schema = json.dumps({"type": "object", "properties": properties, "required": ["field_0"]})
    return json.dumps(
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "json_schema": schema, "n": 16}}
    ).encode()


def payload_body() -> bytes:
    """``bytearray(2**30)`` as a weight payload: 40 bytes of pickle (``tests/test_weight_wire.py``)."""
    import base64
    import pickle

    gadget = (
        pickle.PROTO
        + b"\x02"
        + pickle.GLOBAL
        + b"builtins\nbytearray\n"
        + pickle.BININT
        + (2**30).to_bytes(4, "little")
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    return json.dumps({"serialized_named_tensors": [base64.b64encode(gadget).decode()]}).encode()


def slow_clients_arm(url: str, count: int, seconds: float) -> dict[str, float]:
    """``/health`` while ``count`` connections hold half a request's headers, for ``seconds`` past the
    header deadline; then how many the server closed."""
    import socket
    from urllib.parse import urlsplit

    from inverted.processes import HEADERS_TIMEOUT_S

    parts = urlsplit(url)
    held = []
    for _ in range(count):
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        held.append(sock)
    out = health_while(url, HEADERS_TIMEOUT_S + seconds)
    closed = 0
    for sock in held:
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:  # still open: nothing to read and no end
            pass
        except ConnectionResetError:
            closed += 1
        sock.close()
    return out | {"held": count, "closed_by_server": closed}


def peak_rss_mb(proc: ManagedProcess) -> float:
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(proc: ManagedProcess) -> float:
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def sessions_arm(proxy: ManagedProcess, cap: int) -> dict[str, float]:
    before = rss_mb(proxy)
    opened = refused = 0
    with httpx.Client(timeout=60) as http:
        while opened < cap:
            response = http.post(proxy.url + "/sessions/batch", json={"sessions": [{}] * min(128, cap - opened)})
            if response.status_code != 200:
                break
            opened += len(response.json()["sessions"])
        full = rss_mb(proxy)
        for _ in range(max(1, cap // 128)):
            refused += http.post(proxy.url + "/sessions/batch", json={"sessions": [{}] * 128}).status_code == 429
    return {
        "cap": cap,
        "opened": opened,
        "batches_refused_429": refused,
        "rss_empty_mb": before,
        "rss_at_cap_mb": full,
        "rss_after_refusals_mb": rss_mb(proxy),
        "kb_per_session": 1024 * (full - before) / max(opened, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen2", help="checkpoint (made if missing)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each arm")
    parser.add_argument("--text-mb", type=float, default=20.0, help="prompt text under the body limits")
    parser.add_argument("--body-mb", type=float, default=100.0, help="a body over every default limit")
    parser.add_argument("--max-sessions", type=int, default=16384)
    parser.add_argument("--slow-clients", type=int, default=2000, help="connections that never finish a request")
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), arch="qwen2", preset="tiny"))
    log_dir = Path("runs/bench/hostile")
    procs = start_stack(model, log_dir, proxy_args=("--proxy-max-sessions", str(args.max_sessions)))
    try:
        engine, proxy = procs["engine"].url, procs["proxy"].url
        text = "lorem ipsum " * int(args.text_mb * 1e6 / 12)
        session = httpx.post(proxy + "/sessions", json={}).json()
        engine_text = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()
        proxy_text = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        ).encode()
        body = b'{"text": "' + b"x" * int(args.body_mb * 1e6) + b'"}'
        result = {"idle_engine": health_while(engine, args.seconds), "idle_proxy": health_while(proxy, args.seconds)}
        chat = session["base_url"] + "/chat/completions"
        result["engine_text"] = health_while(engine, args.seconds, engine + "/generate", engine_text)
        result["proxy_text"] = health_while(proxy, args.seconds, chat, proxy_text)
        result["engine_body"] = health_while(engine, args.seconds, engine + "/generate", body)
        result["proxy_body"] = health_while(proxy, args.seconds, chat, body)
        for arm, idle in (
            ("engine_text", "idle_engine"),
            ("engine_body", "idle_engine"),
            ("proxy_text", "idle_proxy"),
            ("proxy_body", "idle_proxy"),
        ):
            result[arm]["p99_over_idle"] = result[arm]["health_p99_ms"] / result[idle]["health_p99_ms"]
        result["engine_grammar"] = health_while(engine, args.seconds, engine + "/generate", grammar_body())
        peak = peak_rss_mb(procs["engine"])
        httpx.post(engine + "/begin_weight_update", json={}).raise_for_status()  # where payloads are decoded
        result["engine_payload"] = health_while(
            engine, args.seconds, engine + "/update_weights_from_tensor", payload_body()
        )
        httpx.post(engine + "/end_weight_update", json={}).raise_for_status()
        result["engine_payload"] |= {"peak_rss_mb_before": peak, "peak_rss_mb_after": peak_rss_mb(procs["engine"])}
        for arm in ("engine_grammar", "engine_payload"):
            result[arm]["p99_over_idle"] = result[arm]["health_p99_ms"] / result["idle_engine"]["health_p99_ms"]
        many = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "n": 100_000}}).encode()
        result["engine_n"] = health_while(engine, args.seconds, engine + "/generate", many)
        result["slow_clients"] = slow_clients_arm(engine, args.slow_clients, args.seconds)
        for arm in ("engine_n", "slow_clients"):
            result[arm]["p99_over_idle"] = result[arm]["health_p99_ms"] / result["idle_engine"]["health_p99_ms"]
        result["sessions"] = sessions_arm(procs["proxy"], args.max_sessions)
        result["config"] = vars(args)
        print(json.dumps(result, indent=2))
    finally:
        for proc in procs.values():
            proc.terminate()


if __name__ == "__main__":
    main()
