"""The recorder: one call on one session, from request to recorded turn and answer, whatever the API.

For each call it (1) places the request on a branch (``Session.place``), (2) builds the prompt
ids: the base branch's tokens as they are, plus the bridge for what the client appended (chat:
``ChatRenderer.bridge``; text completions: the new suffix of the prompt, tokenized), or a full
render for a new branch, (3) samples ``n`` choices on the router (``generation.sample_turn``),
(4) records each choice as a turn of its branch and (5) answers with an ``apis.call.Answer``, whole
or as a stream of events, which the request's API module shapes. A call that fails at any point is
rolled back, all its choices together: nothing is recorded for it.

Streaming is real: text deltas leave as the engine produces tokens. Text that may open a tool
call (the parser's ``start`` marker, or a prefix of it) is held back; tool calls are parsed from
the whole turn at its end and arrive in its ``Output``.

No FastAPI here, nor any API's shapes: ``service`` owns HTTP, ``apis`` the shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inverted.errors import InvalidRequest
from inverted.hf_checkpoint import longest_prompt, room_after
from inverted.limits import cannot_fit, max_token_chars
from inverted.rollout.chat import THINK_OPEN, ChatRenderer, Message, ParsedReply, TemplateBreak, ToolParser, tools_key
from inverted.rollout.proxy import hosted
from inverted.rollout.proxy.apis import call
from inverted.rollout.proxy.apis.call import (
    MAX_TOKENS_REASON,
    Answer,
    CallRequest,
    Delta,
    Event,
    Hosted,
    Output,
    TokenLogprob,
)
from inverted.rollout.proxy.config import ProxyConfig
from inverted.rollout.proxy.generation import Sampled, sample_turn, scripted_turn
from inverted.rollout.proxy.session import Branch, History, Placement, Session, Sessions, Turn
from inverted.rollout.sglang_client import GenerateClient

OPEN_TAIL = 16  # prompt ids read for an open think block: "<think>" and its newline, in any tokenizer


class ProxyMetrics:
    """Prometheus counters of one proxy process (its own registry: no global state)."""

    def __init__(self, sessions: Sessions):
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("inverted_proxy_turns", "recorded turns (one per choice)", registry=r)
        self.prompt_tokens = Counter("inverted_proxy_prompt_tokens", "prompt tokens sent to the servers", registry=r)
        self.completion_tokens = Counter("inverted_proxy_completion_tokens", "tokens sampled", registry=r)
        self.branches = Counter(
            "inverted_proxy_branches",
            "branches beyond a session's first (history rewritten, retried or parallel calls)",
            registry=r,
        )
        self.template_breaks = Counter(
            "inverted_proxy_template_breaks", "bridges refused: template not append-only", registry=r
        )
        self.replays = Counter("inverted_proxy_replays", "retried calls answered from the record", registry=r)
        self.resumes = Counter("inverted_proxy_resumes", "aborted calls resumed from their tokens", registry=r)
        self.retries = Counter("inverted_proxy_retries", "aborted calls sampled again", registry=r)
        self.rejected = Counter(
            "inverted_proxy_rejected", "requests answered with a 4xx", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "inverted_proxy_call_latency_seconds",
            "call latency (whole call)",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        for name, doc in (
            ("created", "sessions created"),
            ("finished", "sessions finished"),
            ("expired", "sessions finished by the idle timeout"),
        ):
            Gauge(f"inverted_proxy_sessions_{name}_total", doc, registry=r).set_function(
                lambda name=name: sessions.counts[name]  # type: ignore[misc]  # (mypy cannot type a default's lambda)
            )
        Gauge("inverted_proxy_sessions_active", "sessions not yet finished", registry=r).set_function(
            lambda: sessions.active
        )


@dataclass(slots=True)
class Choice:
    """One choice of a call: its branch, where its prompt ends, and (once done) what it produced."""

    index: int
    branch: Branch
    placement: Placement
    prompt_len: int
    incoming: History  # the request's history, which the turn's extends by its reply
    forced: str = ""  # the start of a tool call written after the prompt (tool_choice required or named)
    opened: str = ""  # a think block the prompt's end left open (``Recorder._opened``), which the reply continues
    script: list[int] | None = None  # a scripted session's reply for this call, answered instead of sampling
    state: Sampled | None = None
    output: Output | None = None  # set when sampled
    turn: Turn | None = None  # set when sampled; recorded only once every choice of the call succeeded

    @property
    def lead(self) -> str:
        """Text before the reply that the reply continues: an open think block, a forced call's opening."""
        return self.opened + self.forced

    @property
    def ended(self) -> Output:
        """The choice's Output, once it was sampled."""
        assert self.output is not None, f"choice {self.index} has not been sampled"
        return self.output

    @property
    def sampled(self) -> Sampled:
        """The choice's last sampling state, once it started."""
        assert self.state is not None, f"choice {self.index} has not started sampling"
        return self.state


class Recorder:
    def __init__(
        self,
        config: ProxyConfig,
        tokenizer: Any,
        client: GenerateClient,
        parser: ToolParser,
        context_length: int,
        model_name: str,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)
        self.client = client
        self.parser = parser
        self.context_length = context_length
        self.model_name = model_name
        self.hosted = hosted.HostedTools(config.proxy_hosted_tools)
        self.sessions = Sessions(
            idle_timeout=config.proxy_session_timeout,
            retention=config.proxy_retention,
            max_turns=config.proxy_max_turns,
            max_sessions=config.proxy_max_sessions,
        )
        self.metrics = ProxyMetrics(self.sessions)

    def offer(self, req: CallRequest) -> None:
        """Show the model each hosted tool the request declared that an implementation serves; note why
        the others are left out (``hosted.offered``)."""
        if not req.hosted:
            return
        req.tools = (
            hosted.offered(req.tools or [], req.hosted, req.hosted_names, req.accepted, self.hosted.kinds) or None
        )
        req.parse_tools = req.parse_tools and bool(req.tools)
        if req.hosted_names and req.n > 1:
            raise InvalidRequest(
                "hosted tools run inside the call, one reply at a time: n must be 1 with "
                f"{sorted(set(req.hosted_names.values()))}",
                param="n",
                code="unsupported_parameter",
            )

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a call samples from: SGLang's ``model: "base:adapter"`` (``base`` being the
        served model's name), else ``--lora-name`` (a LoRA run's policy), else none: the base model."""
        base, _, adapter = (model or "").partition(":")
        return adapter if adapter and base == self.model_name else self.config.lora_name

    # ---- placing and prompting -------------------------------------------------------------

    def _incoming(self, req: CallRequest) -> History:
        if req.kind == "text":
            return req.text
        return (tools_key(req.tools), tuple(m.key for m in req.chat))

    def _fresh_prompt(self, req: CallRequest) -> list[int]:
        if req.kind == "text":
            return self.renderer.encode(req.text)
        return self.renderer.prompt_ids(req.chat, req.tools, thinking=self._thinking(req))

    def _bridge(self, placement: Placement, req: CallRequest) -> list[int]:
        branch = placement.branch
        assert placement.base_turn is not None  # a bridge extends a recorded turn
        turn = branch.turns[placement.base_turn]
        sampled = branch.tokens[turn.start : turn.end]
        size = placement.extended  # its history's, or its echo's (a caller that saw no hosted round)
        if req.kind == "text":
            return self.renderer.encode(req.text[size:])
        return self.renderer.bridge(req.chat[:size], req.chat[size:], req.tools, sampled, thinking=self._thinking(req))

    def _thinking(self, req: CallRequest) -> bool | None:
        """The template's thinking switch for this call, where it has one and the call asked; a call that
        asked of a template without one has its field accepted, with the reason."""
        if req.thinking is None:
            return None
        params, on = req.thinking
        if self.renderer.thinking_switch:
            return on
        for param in params:
            req.accepted[param] = (
                "the chat template has no thinking mode: the model answers as it does at "
                "effort 'none'" + ("" if on else ", which is what was asked")
            )
        return None

    def _check_length(self, req: CallRequest, placement: Placement | None = None) -> None:
        """Refuse, by its length alone, text that cannot fit the context: tokenizing 20 MB took 30 s
        (and rendering 10,000 tools 25 s). Names and tools count as text: a template that renders
        them writes at least that much, and a session keeps them in its Samples either way. On a
        recorded turn's branch (``placement``) only what the request appends is rendered, so only
        that counts, against the room the branch's tokens leave: a long session's turn costs no
        more to check than its first."""
        skip = held = 0
        if placement is not None and placement.base_turn is not None:
            skip, held = placement.extended, placement.branch.turns[placement.base_turn].end
        if req.kind == "text":
            chars = len(req.text) - skip
        else:
            chars = sum(
                len(m.content) + len(m.name or "") + sum([len(c.name) + len(c.arguments) for c in m.tool_calls])
                for m in req.chat[skip:]
            )
            chars += 0 if skip else sum(len(json.dumps(tool, separators=(",", ":"))) for tool in req.tools or [])
        room = longest_prompt(self.context_length) - held  # a longer max_tokens is cut to what is left (_check_context)
        if cannot_fit(chars, room, self.max_token_chars):
            after = f" after the {held} tokens of the session's history" if held else ""
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_length} tokens. However, your messages and "
                f"tools hold {chars} characters{after}, more than the {room} tokens left for them can hold (one "
                f"token covers at most {self.max_token_chars} characters). Please reduce the length of the messages, "
                "tools or completion.",
                param="messages",
                code="context_length_exceeded",
            )

    async def _open(self, session: Session, req: CallRequest) -> list[Choice]:
        """Place every choice, append its prompt ids, and check the context; nothing is kept on error.

        Rendering and tokenizing run on a worker thread, so that other sessions' calls and
        ``/health`` are served meanwhile; the caller holds the session's ``opening`` lock, so no
        other call of this session places itself in between (a fork's branch is its own copy).
        """
        incoming = self._incoming(req)
        first = session.place(incoming)
        self._check_length(req, first)
        if first.base_turn is None:
            delta = await asyncio.to_thread(self._fresh_prompt, req)
        else:
            try:
                delta = await asyncio.to_thread(self._bridge, first, req)
            except TemplateBreak:
                self.metrics.template_breaks.inc()
                first = Placement(Branch(), None, False, 0)
                delta = await asyncio.to_thread(self._fresh_prompt, req)
        forced = self._forced(req)
        # a call forced right after an open think block is the call's text, not reasoning
        opened = self._opened(first.branch.tokens[-OPEN_TAIL:] + delta) if req.kind == "chat" and not forced else ""
        if forced:  # prompt tokens to the model, not sampled: masked out like the template's
            delta = delta + self.renderer.encode(forced)
        session.check_open()  # it may have been finished while this call's prompt was tokenized
        base_len = len(first.branch.tokens)
        prompt_len = base_len + len(delta)
        self._check_context(prompt_len, req)
        session.check_tokens(len(delta) + (0 if first.in_place else base_len), self.config.proxy_max_session_tokens)
        # the Sample's prompt, for a branch that starts here (a whole history's worth: not on every turn)
        prompt = (
            None
            if first.base_turn is not None
            else [m.to_template() for m in req.chat]
            if req.kind == "chat"
            else req.prompt
        )
        choices: list[Choice] = []
        for index in range(req.n):
            placement = (
                first
                if index == 0
                else (session.place(incoming) if first.base_turn is not None else Placement(Branch(), None, False, 0))
            )
            if not placement.in_place and session.branches:
                self.metrics.branches.inc()
            branch = session.open(placement, prompt)
            branch.append_prompt(delta)
            choices.append(
                Choice(index, branch, placement, prompt_len, incoming, forced, opened, self._scripted(session, req))
            )
        return choices

    @staticmethod
    def _scripted(session: Session, req: CallRequest) -> list[int] | None:
        """A scripted session's next reply (taken for good once the call is recorded, ``_settle``)."""
        if session.script is None:
            return None
        if req.n != 1:
            raise InvalidRequest(
                f"session {session.id} answers from a script, one reply per call; this call asked for n={req.n}",
                param="n",
                code="unsupported_parameter",
            )
        if session.turns >= len(session.script):
            raise InvalidRequest(
                f"session {session.id} answers from a script of {len(session.script)} replies, and "
                "this call would need one more: the agent made more calls than the recorded episode",
                code="script_exhausted",
                status=409,
            )
        return session.script[session.turns]

    def _opened(self, prompt: list[int]) -> str:
        """The think block the prompt's end leaves open, as text ("<think>\\n"), else "". Templates of
        models that always think (DeepSeek-R1's, QwQ's, Qwen3-Thinking-2507's) open it in the generation
        prompt, so the reply starts inside its reasoning: each API splits the reply as if it had opened
        the block itself, streamed or not, and a reply cut short is all reasoning."""
        tail = self.tokenizer.decode(prompt[-OPEN_TAIL:], skip_special_tokens=False)
        at = tail.rfind(THINK_OPEN)
        return tail[at:] if at >= 0 and not tail[at + len(THINK_OPEN) :].strip() else ""

    def _forced(self, req: CallRequest) -> str:
        """``tool_choice`` required or named: the call's opening text, which the model then completes."""
        if req.force_call is None:
            return ""
        forced = getattr(self.parser, "forced", None)
        if forced is None:
            raise InvalidRequest(
                f"tool_choice {'required' if not req.force_call else req.force_call!r} needs a tool "
                f"parser that can open a call; {type(self.parser).__name__} (--proxy-tool-parser-path) "
                "has no forced(name)",
                param="tool_choice",
                code="unsupported_parameter",
            )
        return forced(req.force_call)

    def _check_context(self, prompt_len: int, req: CallRequest) -> None:
        """One rule in every API: a reply limit past what the servers sample after this prompt
        (``room_after``: SGLang's, 2 short of the context) is cut to it, and the turn says so (harnesses
        ask for 32,000 or 128,000 tokens of a model they do not know); a prompt longer than the servers
        take (``longest_prompt``: SGLang refuses the last 6 tokens of the context) is refused with the
        API's context error."""
        limit = self.context_length
        if prompt_len > longest_prompt(limit):
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, your messages hold {prompt_len} "
                f"tokens, and its servers take a prompt of at most {longest_prompt(limit)} tokens. Please reduce "
                "the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        room = room_after(prompt_len, limit)
        if req.max_tokens is not None and req.max_tokens > room:
            req.accepted[req.max_tokens_field] = f"{MAX_TOKENS_REASON} ({room} of the {req.max_tokens} tokens asked)"
            req.max_tokens = room

    async def count(self, req: CallRequest) -> int:
        """The prompt tokens a call would start a new branch with (its template render), recording nothing."""
        self._check_length(req)
        return len(await asyncio.to_thread(self._fresh_prompt, req))

    # ---- one call ------------------------------------------------------------------------------

    async def complete(
        self, session: Session, req: CallRequest, replay_key: str | None = None, replay: bool = False
    ) -> Answer:
        """A whole (non-streamed) answer; identical retried calls can be answered from the record."""
        if replay_key is not None and replay and replay_key in session.replays:
            self.metrics.replays.inc()
            return await asyncio.shield(session.replays[replay_key])
        future: asyncio.Future | None = None
        if replay_key is not None:
            future = session.replays[replay_key] = asyncio.get_running_loop().create_future()
        try:
            answer = await self._complete(session, req)
        except BaseException:
            if replay_key is not None and future is not None:
                del session.replays[replay_key]
                future.cancel()
            raise
        if future is not None:
            future.set_result(answer)
        return answer

    async def _complete(self, session: Session, req: CallRequest) -> Answer:
        """The call's reply, after every round of hosted calls it made."""
        answer = await self._round(session, req)
        rounds: list[hosted.Round] = []
        while (after := await self._run_hosted(session, req, answer.outputs[0], rounds)) is not None:
            req = after
            answer.outputs = (await self._round(session, req)).outputs
        answer.outputs[0].rounds = rounds
        if req.on_recorded is not None:
            req.on_recorded(answer)
        return answer

    async def _run_hosted(
        self, session: Session, req: CallRequest, output: Output, rounds: list[hosted.Round]
    ) -> CallRequest | None:
        """Run the hosted calls of a reply; the request to sample next, or None when the reply is the answer:
        it made no hosted call, it also called the agent's own tools (they go back together), the call's
        limit of hosted calls or of tokens is reached."""
        names = req.hosted_names
        calls = [c for c in output.reply.tool_calls if c.name in names]
        if not calls:
            return None
        ids = tuple(c.id for c in output.reply.tool_calls)
        limit = hosted.MAX_CALLS if req.hosted_limit is None else req.hosted_limit
        room = limit - sum(len(r.hosted) for r in rounds)
        over = f"this response's limit of {limit} hosted tool calls is reached"
        ran = [
            *await asyncio.gather(*(self.hosted.run(names[c.name], c, ids) for c in calls[: max(room, 0)])),
            *(hosted.failed(names[c.name], c, ids, over) for c in calls[max(room, 0) :]),
        ]
        output.hosted = {h.call.id: h for h in ran}
        session.hosted.update(output.hosted)
        left = None if req.max_tokens is None else req.max_tokens - output.tokens
        if len(calls) < len(output.reply.tool_calls) or len(calls) > room or left == 0:
            return None
        rounds.append(hosted.Round(output.reply, output.hosted, output.tokens))
        history, text = req.shown or (self._incoming(req), "")
        return dataclasses.replace(
            req,
            messages=hosted.follow_up(req.chat, output.reply, ran),
            force_call=None,
            max_tokens=left,
            on_recorded=None,
            shown=(history, text + (output.reply.content or "")),
        )

    async def _round(self, session: Session, req: CallRequest) -> Answer:
        started = time.monotonic()
        choices = await self._start(session, req)
        answer = Answer(model=req.model or self.model_name, prompt_tokens=choices[0].prompt_len)

        async def run(choice: Choice) -> None:
            async with aclosing(self._sample(req, choice, stream=False)) as updates:
                async for _ in updates:
                    pass

        succeeded = False
        try:
            async with asyncio.TaskGroup() as group:  # one failed choice cancels the others
                for choice in choices:
                    group.create_task(run(choice))
            answer.outputs = [c.ended for c in choices]
            succeeded = True
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            self._settle(session, req, answer, choices, succeeded)
        self.metrics.latency.observe(time.monotonic() - started)
        return answer

    async def stream(self, session: Session, req: CallRequest) -> AsyncGenerator[Event, None]:
        """The ``Answer`` once the call is placed, then each choice's ``Delta``s as tokens arrive
        (choices interleaved) and its ``Output`` as it ends; the call is recorded before the end.
        A reply whose hosted calls ran is a ``Hosted`` event, and the next reply's events follow."""
        opened: Answer | None = None
        rounds: list[hosted.Round] = []
        while True:
            held: Output | None = None
            async with aclosing(self._stream_round(session, req)) as events:
                async for event in events:
                    if isinstance(event, Answer):
                        if opened is None:
                            opened = event
                            yield event
                    elif isinstance(event, Output) and req.hosted_names:
                        held = event  # the call's answer only once its hosted calls are known
                    else:
                        yield event
            assert opened is not None  # every round opens with its Answer
            if held is None:
                break
            after = await self._run_hosted(session, req, held, rounds)
            if after is None:
                held.rounds = rounds
                opened.outputs = [held]
                yield held
                break
            yield Hosted(held.index, rounds[-1])
            req = after
        if req.on_recorded is not None:
            req.on_recorded(opened)

    async def _stream_round(self, session: Session, req: CallRequest) -> AsyncGenerator[Event, None]:
        """One reply's events (``stream`` without hosted rounds)."""
        started = time.monotonic()
        choices = await self._start(session, req)
        answer = Answer(model=req.model or self.model_name, prompt_tokens=choices[0].prompt_len)
        yield answer
        queue: asyncio.Queue[Delta | Output | BaseException | None] = asyncio.Queue()

        async def run(choice: Choice) -> None:
            try:
                async with aclosing(self._stream_choice(req, choice)) as events:
                    async for event in events:
                        await queue.put(event)
                await queue.put(None)
            except Exception as exc:  # handed to the consumer, which raises it in the response
                await queue.put(exc)

        tasks = [asyncio.create_task(run(c)) for c in choices]
        succeeded = False
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    if isinstance(item, Output):
                        answer.outputs.append(item)
                    yield item
            answer.outputs.sort(key=lambda o: o.index)
            succeeded = True
            self.metrics.latency.observe(time.monotonic() - started)
        finally:
            # Settled before any await: a server that cancels a hung-up stream cancels every later
            # await here too. A cancelled choice cannot append to its branch any more (it appends
            # with no await after its last one), so rolling back now is final.
            for task in tasks:
                task.cancel()
            self._settle(session, req, answer, choices, succeeded)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _start(self, session: Session, req: CallRequest) -> list[Choice]:
        session.check_open()
        session.touch()
        async with session.opening:
            return await self._open(session, req)

    async def _sample(self, req: CallRequest, choice: Choice, *, stream: bool) -> AsyncGenerator[Sampled, None]:
        """Sample one choice, yielding its growing state; when done, its sampled ids join the branch and
        ``choice.turn`` and ``choice.output`` are set (``_settle`` records the turn or rolls the branch back)."""
        created = time.time()
        budget = req.max_tokens or room_after(choice.prompt_len, self.context_length)
        sampling = {**req.sampling, "max_new_tokens": budget}
        prompt = choice.branch.tokens[: choice.prompt_len]
        # the routed experts the branch's turns hold already cover tokens[:last turn's end - 1]
        turns = choice.branch.turns
        routes_from = (turns[-1].end - 1 if turns else 0) if self.config.return_routed_experts else None
        constrained = "json_schema" in sampling
        if choice.script is not None:
            replies = scripted_turn(choice.script, sampling["max_new_tokens"])
        else:
            replies = sample_turn(
                self.client,
                prompt,
                sampling,
                stream=stream,
                lora_path=self._adapter(req.model),
                # a constrained call resumed would restart its grammar: sampled again
                partial_rollout=self.config.partial_rollout and not constrained,
                max_resumes=self.config.proxy_max_resumes,
                top_logprobs=req.top_logprobs,
                routes_from=routes_from,
                routes_version=turns[-1].routes_version if turns else None,
                server_loss_wait=self.config.proxy_server_loss_wait,
                mask_top_k=self.config.sampling_mask_top_k,
                prompt_limit=longest_prompt(self.context_length),
            )
        async for update in replies:
            choice.state = update
            yield update
        state = choice.sampled
        text, stop = self._decode(state, req.sampling.get("stop", []))
        text = choice.lead + text
        reply = self.parser.parse(text) if req.parse_tools else ParsedReply(content=text)
        finish = call.finish_reason(state.reason, reply)
        choice.output = Output(
            index=choice.index,
            text=text,
            reply=reply,
            finish=finish,
            stop=stop,
            tokens=len(state.ids),
            logprobs=self._logprobs(state) if req.logprobs else None,
            cached_tokens=state.cached_tokens,
        )
        logprobs, mask, how = recorded_logprobs(state, constrained, self.config.proxy_constrained_tokens)
        choice.branch.append_sampled(state.ids, logprobs, state.versions, mask)
        choice.turn = Turn(
            start=choice.prompt_len,
            end=len(choice.branch.tokens),
            history=self._history_after(req, choice.incoming, reply),
            finish_reason=finish,
            sampling_params=sampling,
            created=created,
            latency_s=time.time() - created,
            resumes=state.resumes,
            routes=state.routes,
            routes_from=state.routes_from,
            routes_version=state.routes_version,
            constrained=how,
            accepted=dict(req.accepted),
            model=req.model,
            cached_tokens=state.cached_tokens,
            forced=choice.forced,
            # under a grammar the recorded logprob is not the kept set's (but the policy's or
            # none), unless the grammar's own distribution is what is recorded
            kept=state.kept if any(state.kept) and how in (None, "constrained") else None,
            echo=self._echo(req, reply),
        )

    def _settle(
        self, session: Session, req: CallRequest, answer: Answer, choices: list[Choice], succeeded: bool
    ) -> None:
        """All or nothing: every choice's turn is recorded, or every branch is rolled back."""
        for choice in choices:
            turn = choice.turn if succeeded else None
            session.close(choice.branch, choice.placement, turn)
            if turn is not None:
                self.metrics.turns.inc()
                self.metrics.prompt_tokens.inc(choice.prompt_len)
                self.metrics.completion_tokens.inc(turn.end - turn.start)
                self.metrics.resumes.inc(choice.sampled.resumes)
                self.metrics.retries.inc(choice.sampled.retries)

    async def _stream_choice(self, req: CallRequest, choice: Choice) -> AsyncGenerator[Delta | Output, None]:
        """One choice's visible text as it grows (tool-call text held back), the rest of its content, its Output."""
        sent = 0
        async with aclosing(self._sample(req, choice, stream=True)) as updates:
            async for state in updates:
                decoded = self.tokenizer.decode(state.ids, skip_special_tokens=True)
                visible = self._visible(req, choice.lead + decoded)
                if len(visible) > sent:
                    yield Delta(choice.index, visible[sent:])
                    sent = len(visible)
        output = choice.ended
        final = (output.reply.content or "") if req.kind == "chat" else output.text
        if len(final) > sent:
            yield Delta(choice.index, final[sent:])
        yield output

    def _visible(self, req: CallRequest, text: str) -> str:
        """What may be streamed yet: nothing from a tool-call marker or a stop string on (nor a prefix of
        one at the end, which the next token may complete), no half-decoded character, and (with tools)
        no trailing space, which the final content drops before a tool call."""
        text = text.rstrip("\ufffd")
        markers = ([self.parser.start] if req.parse_tools else []) + req.sampling.get("stop", [])
        cut = len(text)
        for marker in markers:
            at = text.find(marker)
            if at < 0:
                at = next(
                    (len(text) - k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])),
                    len(text),
                )
            cut = min(cut, at)
        return text[:cut].rstrip() if req.parse_tools else text[:cut]

    # ---- what a call produced ---------------------------------------------------------------

    def _decode(self, state: Sampled, stops: list[str]) -> tuple[str, str | None]:
        """The sampled text, up to the stop string that ended it, and that string."""
        text = self.tokenizer.decode(state.ids, skip_special_tokens=True)
        if state.reason == "stop" and isinstance((state.finish or {}).get("matched"), str):
            stop = call.first_stop(text, stops)
            return call.before_stop(text, stops), stop
        return text, None

    def _echo(self, req: CallRequest, reply: ParsedReply) -> History | None:
        """After hosted rounds: the caller's history and the one reply it was shown (every round's text,
        this round's calls), which a client that cannot send hosted rounds back sends (``Turn.echo``)."""
        if req.shown is None:
            return None
        history, text = req.shown
        return self._history_after(
            req, history, ParsedReply(content=text + (reply.content or ""), tool_calls=reply.tool_calls)
        )

    def _history_after(self, req: CallRequest, incoming: History, reply: ParsedReply) -> History:
        if isinstance(incoming, str):  # a text call's
            return incoming + (reply.content or "")
        message = Message(role="assistant", content=reply.content or "", tool_calls=tuple(reply.tool_calls))
        tools, keys = incoming
        return (tools, keys + (message.key,))

    def _logprobs(self, state: Sampled) -> list[TokenLogprob]:
        decode = self.tokenizer.decode
        tops = state.tops or [[] for _ in state.ids]
        return [
            TokenLogprob(decode([t]), lp, [(decode([tid]), tlp) for tlp, tid in top])
            for t, lp, top in zip(state.ids, state.logprobs, tops)
        ]


def recorded_logprobs(state: Sampled, constrained: bool, mode: str) -> tuple[list[float], list[int], str | None]:
    """What a turn's sampled tokens are recorded with: their logprobs, their loss mask, and for a call
    under a grammar (``constrained``) which way ``--proxy-constrained-tokens`` chose: ``"policy"``
    (the policy's own logprobs, which the server reported), ``"masked"`` (out of the loss: asked
    for, or the server reported none) or ``"constrained"`` (the masked distribution's, as returned)."""
    n = len(state.ids)
    if not constrained:
        return state.logprobs, [1] * n, None
    if mode == "constrained":
        return state.logprobs, [1] * n, "constrained"
    unconstrained = [lp for lp in state.unconstrained if lp is not None]
    if mode == "policy" and len(unconstrained) == n:
        return unconstrained, [1] * n, "policy"
    return [0.0] * n, [0] * n, "masked"  # mask-0 tokens carry logprob 0.0, as tool output does
