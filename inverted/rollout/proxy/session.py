"""Sessions: each episode's exact token history, as a set of branches, and the Samples they become.

A **branch** is one linear token sequence (``tokens`` with a parallel ``mask``, ``logprobs`` and
``versions``) and the **turns** that sampled into it. A turn remembers the *history* a client
will send back to continue it: for chat, the tools and the message keys (the request's messages
plus the reply); for text completions, the prompt text plus the completion text.

``Session.place`` decides where a request goes. The branch and turn whose history the request
extends the furthest is the base:
- it is the branch's last turn and no call is running on it: the branch grows in place;
- otherwise (the agent edited, dropped or retried history, or runs calls in parallel) a new
  branch is forked from that turn's tokens (everything up to the end of its sampled ids);
- nothing matches: a new branch from a full render.
Messages match by key, or as a known rewrite of a recorded reply (``rewrites``).
So every branch is internally exact: its tokens are exactly what the engine saw and produced.
Each branch becomes one Sample (one per leaf; shared prefixes appear in each, as in miles and
verifiers). A call that fails rolls its tokens back: nothing is recorded for it.

This module is pure bookkeeping (no I/O, no FastAPI); ``service`` drives it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from inverted.errors import InvalidRequest
from inverted.rollout.chat import ParsedMessages, tools_key
from inverted.rollout.proxy import rewrites
from inverted.types import Reward, Sample, decode_routed_experts, encode_routed_experts

MAX_REFUSALS = 8  # a session keeps its latest refused calls, for the failed episode to report
History = tuple[str, tuple] | str  # (tools key, message keys) for chat; the text so far for completions


def extends(history: History, incoming: History) -> bool:
    if isinstance(history, str) or isinstance(incoming, str):
        return isinstance(history, str) and isinstance(incoming, str) and incoming.startswith(history)
    tools, messages = history
    if tools != incoming[0] or len(incoming[1]) < len(messages):
        return False
    return incoming[1][: len(messages)] == messages or all(map(rewrites.same, messages, incoming[1]))


def lineage_key(prompt: Any) -> str | None:
    """What names a branch's lineage: the agent prompt it opened with (its first system or developer
    message), else its first user message; a text prompt has none (one lineage)."""
    if not isinstance(prompt, list):
        return None
    for roles in (("system", "developer"), ("user",)):
        first = next((m for m in prompt if isinstance(m, dict) and m.get("role") in roles), None)
        if first is not None:
            return json.dumps(first.get("content"), sort_keys=True)
    return None


def offers_tools(history: History) -> bool:
    """Whether a chat call's history was offered tools (its tools key names any)."""
    return isinstance(history, tuple) and history[0] != tools_key(None)


def history_size(history: History) -> int:
    return len(history) if isinstance(history, str) else len(history[1])


def joined_routes(turns: list[Turn]) -> str | None:
    """The turns' routed experts (each SGLang's base64 of int32, from where the previous turn's ended, or
    the whole sequence's where a turn read them again after a weight update) as one record of the whole
    branch; None unless every turn from the last whole one has its part."""
    whole = max((i for i, turn in enumerate(turns) if turn.routes_from == 0), default=0)
    parts = [turn.routes for turn in turns[whole:] if turn.routes is not None]
    if not parts or len(parts) < len(turns) - whole:
        return None
    if len(parts) == 1:
        return parts[0]
    import numpy as np

    return encode_routed_experts(np.concatenate([decode_routed_experts(part) for part in parts]))


@dataclass(slots=True)
class Turn:
    """One sampled reply: its span in the branch and what was asked and how it ended."""

    start: int  # first sampled token (== the turn's prompt length)
    end: int
    history: History
    finish_reason: str
    sampling_params: dict[str, Any]
    created: float
    latency_s: float
    resumes: int = 0
    routes: str | None = None  # routed experts (MoE, when asked for) of tokens[routes_from:end - 1]
    routes_from: int | None = None  # the previous turn's end - 1, or 0 (read whole again after a weight update)
    routes_version: str | None = None  # the one weight version the branch's record up to here was made under
    constrained: str | None = None  # under a grammar: how its logprobs were recorded (recorder.recorded_logprobs)
    accepted: dict[str, str] = field(default_factory=dict)  # request fields taken without effect, and why
    model: str | None = None  # the model name the call asked for (any is served)
    cached_tokens: int = 0  # of the prompt, served from the server's prefix cache
    forced: str = ""  # the call's opening the proxy wrote before the reply (tool_choice), ending the prompt
    kept: list[list[int]] | None = None  # each sampled token's kept set (sampling masks), when the call had them
    # The history a caller that never saw this call's hosted rounds sends back (Chat, Gemini): its own
    # messages and one reply of every round's text; the next call continues the branch from either.
    echo: History | None = None

    def ends(self, incoming: History) -> int | None:
        """The size of the history of this turn's that ``incoming`` extends, or None."""
        matched = next((h for h in (self.history, self.echo) if h is not None and extends(h, incoming)), None)
        return None if matched is None else history_size(matched)

    def record(self) -> dict[str, Any]:
        record = {
            "prompt_tokens": self.start,
            "completion_tokens": self.end - self.start,
            "start": self.start,
            "end": self.end,
            "finish_reason": self.finish_reason,
            "sampling_params": self.sampling_params,
            "created": self.created,
            "latency_s": round(self.latency_s, 6),
            "resumes": self.resumes,
            "model": self.model,
            "cached_tokens": self.cached_tokens,
        }
        return (
            record
            | ({"constrained": self.constrained} if self.constrained else {})
            | ({"accepted": self.accepted} if self.accepted else {})
            | ({"forced": self.forced} if self.forced else {})
        )


def kept_sets(turns: list[Turn], start: int, end: int) -> tuple[list[int], list[int]] | tuple[None, None]:
    """The Sample's ``rollout_top_p_token_ids`` and ``..._offsets`` for tokens[start:end]: each sampled
    token's kept set from its turn, an empty range for the rest; nothing where no turn recorded any."""
    if not any(turn.kept for turn in turns):
        return None, None
    ids: list[int] = []
    offsets, position = [0], start
    for turn in turns:
        offsets += [offsets[-1]] * (turn.start - position)  # glue and tool output before the turn
        for kept in turn.kept or [[] for _ in range(turn.start, turn.end)]:
            ids += kept
            offsets.append(len(ids))
        position = turn.end
    offsets += [offsets[-1]] * (end - position)
    return ids, offsets


@dataclass(slots=True, eq=False)  # identity, not value: two branches may hold the same tokens
class Branch:
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    prompt: Any = ""  # the messages (or text) of the request that started the branch: the Sample's prompt
    busy: bool = False

    def fork(self, upto_turn: int) -> "Branch":
        end = self.turns[upto_turn].end
        return Branch(
            tokens=self.tokens[:end],
            mask=self.mask[:end],
            logprobs=self.logprobs[:end],
            versions=self.versions[:end],
            turns=list(self.turns[: upto_turn + 1]),
            prompt=self.prompt,
        )

    def append_prompt(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)

    def append_sampled(
        self, ids: list[int], logprobs: list[float], versions: list[str], mask: list[int] | None = None
    ) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids) if mask is None else mask
        self.logprobs += logprobs
        self.versions += versions

    def truncate(self, length: int) -> None:
        for seq in (self.tokens, self.mask, self.logprobs, self.versions):
            del seq[length:]

    def to_sample(self, base: Sample) -> Sample:
        """This branch as a Sample: the response starts at the first sampled token."""
        start, end = self.turns[0].start, self.turns[-1].end  # a call still running is not part of it
        versions: list[str] = []
        following = self.versions[end - 1] or ""
        for v in reversed(self.versions[start:end]):  # glue and tool output carry the version of the turn they precede
            following = v if v is not None else following
            versions.append(following)
        versions.reverse()
        last = self.turns[-1].finish_reason
        status = (
            Sample.Status.TRUNCATED
            if last == "length" or base.status == Sample.Status.TRUNCATED
            else Sample.Status.COMPLETED
        )
        kept_ids, kept_offsets = kept_sets(self.turns, start, end)
        return Sample(
            group_index=base.group_index,
            index=base.index,
            prompt=self.prompt or base.prompt,
            tokens=self.tokens[:end],
            response_length=end - start,
            loss_mask=self.mask[start:end],
            rollout_log_probs=self.logprobs[start:end],
            weight_versions=versions,
            reward=base.reward,
            status=status,
            label=base.label,
            session_id=base.session_id,
            metadata={**base.metadata, "turns": [t.record() for t in self.turns]},
            rollout_routed_experts=joined_routes(self.turns),
            rollout_top_p_token_ids=kept_ids,
            rollout_top_p_token_offsets=kept_offsets,
        )


@dataclass(slots=True)
class Placement:
    """Where a request's tokens go: ``branch`` (new or forked unless ``in_place``) after ``base_turn``."""

    branch: Branch
    base_turn: int | None  # None: a fresh render
    in_place: bool
    rollback_to: int  # length to truncate back to if the call fails
    extended: int = 0  # how many of the request's messages (text: characters) the base turn's history holds


class Session:
    """One episode. Ids and tokens are unguessable; the token is the session's own credential.

    ``template`` is the Sample the episode is for, as its task made it (``Task.new_sample``: group,
    index, prompt, label, metadata); each branch becomes a copy of it with the recorded tokens.
    """

    def __init__(
        self,
        metadata: dict[str, Any],
        overrides: dict[str, Any] | None = None,
        max_turns: int = 0,
        template: Sample | None = None,
        script: list[list[int]] | None = None,
    ):
        self.id = "sess_" + secrets.token_urlsafe(18)
        self.token = "sk-sess-" + secrets.token_urlsafe(32)
        self.metadata = metadata
        self.template = template or Sample()
        self.overrides = overrides or {}  # sampling fields that replace the agent's on every call
        self.max_turns = max_turns
        # Replies given in advance (token ids, in call order) that its calls answer with instead of
        # sampling: a recorded episode played again through another agent. Its Samples carry no
        # rollout log-probs, since no policy sampled them.
        self.script = script
        self.created = self.last_active = time.time()
        self.branches: list[Branch] = []
        self.reward: Reward | None = None
        self.finished_by_agent: bool | None = None
        self.samples: list[Sample] | None = None  # set once finished
        self.expired = False
        self.inflight = 0
        self.turns = 0
        self.replays: dict[str, Any] = {}
        self.stored: dict[str, Any] = {}  # what an API keeps for later calls (Responses' previous_response_id)
        self.hosted: dict[str, Any] = {}  # hosted tool calls the proxy ran, by call id (``hosted.HostedCall``)
        self.parsed = ParsedMessages()  # the chat messages it sent last, so that the next call parses only its new ones
        self.refused: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_REFUSALS)  # its latest 4xx
        self.opening = asyncio.Lock()  # one call of this session at a time finds its place and tokenizes

    @property
    def finished(self) -> bool:
        return self.samples is not None

    def touch(self) -> None:
        self.last_active = time.time()

    def check_tokens(self, adding: int, limit: int) -> None:
        """Refuse a call that would take this session's recorded tokens (all branches) past ``limit``."""
        held = sum(len(branch.tokens) for branch in self.branches)
        if held + adding > limit:
            raise InvalidRequest(
                f"session {self.id} would record {held + adding} tokens over its branches, more than "
                f"the {limit} one session may hold (--proxy-max-session-tokens); start a new session",
                param="messages",
                code="session_too_large",
            )

    def check_open(self) -> None:
        if self.finished:
            raise InvalidRequest(
                f"session {self.id} is finished; start a new session", code="session_finished", status=409
            )
        if self.max_turns and self.turns >= self.max_turns:
            raise InvalidRequest(
                f"session {self.id} reached its limit of {self.max_turns} turns", code="turn_limit_reached", status=409
            )

    def place(self, incoming: History) -> Placement:
        """Pick the branch and turn this request continues (see the module docstring)."""
        best: tuple[int, Branch, int] | None = None
        for branch in self.branches:
            for i in range(len(branch.turns) - 1, -1, -1):
                size = branch.turns[i].ends(incoming)
                if size is not None:
                    if best is None or size > best[0] or (size == best[0] and not branch.busy and best[1].busy):
                        best = (size, branch, i)
                    break
        if best is None:
            return Placement(Branch(), None, False, 0)
        size, branch, turn = best
        if turn == len(branch.turns) - 1 and not branch.busy:
            return Placement(branch, turn, True, len(branch.tokens), size)
        return Placement(branch.fork(turn), turn, False, 0, size)

    def open(self, placement: Placement, prompt: Any) -> Branch:
        """Register the placement's branch (new ones are added) and mark it busy. ``prompt`` is the
        request's messages or text, the Sample's prompt if the branch starts here."""
        branch = placement.branch
        if placement.base_turn is None:
            branch.prompt = prompt
        if not placement.in_place:
            self.branches.append(branch)
        branch.busy = True
        self.inflight += 1
        return branch

    def close(self, branch: Branch, placement: Placement, turn: Turn | None) -> None:
        """A call ended: keep its turn, or roll it back (and drop a branch left with no turns)."""
        branch.busy = False
        self.inflight -= 1
        self.touch()
        if turn is not None:
            branch.turns.append(turn)
            self.turns += 1
            return
        branch.truncate(placement.rollback_to)
        if not branch.turns:
            self.branches.remove(branch)

    def set_reward(self, reward: Reward, finished: bool) -> None:
        self.reward = reward
        self.finished_by_agent = finished
        self.touch()

    def finish(self, *, expired: bool = False) -> list[Sample]:
        """Freeze the session into one Sample per branch (idempotent)."""
        if self.samples is None:
            self.expired = expired
            self.samples = self.build_samples()
            self.parsed = ParsedMessages()  # no call follows
        return self.samples

    def main_model(self) -> str | None:
        """The model name most of the session's calls asked for (ties: the first call's)."""
        names = [turn.model for branch in self.branches for turn in branch.turns]
        counts = collections.Counter(names)
        return max(dict.fromkeys(names), key=lambda name: counts[name], default=None)

    def lineages(self) -> dict[int, tuple[str, int | None]]:
        """Each recorded branch's lineage and parent: ``main``, the agent's own trajectory; ``subagent``, a
        call of the main model under another agent prompt (Qwen Code's memory extraction subagent, a
        coding agent's task subagent); ``side``, a call that named another model (a title, a quota
        probe, a second model). A branch is of the main lineage when its model is the main one and it
        opens (``lineage_key``: its agent prompt) as the session's first main-model branch that was
        offered tools did, else as its first main-model branch: an agent's loop runs with its tools,
        while a title written by the same model first (opencode's) is asked without them. The parent
        of the others is the main branch most recently sampled before their first call."""
        main = self.main_model()
        recorded = [(i, b) for i, b in enumerate(self.branches) if b.turns]
        roots = [b for _, b in recorded if b.turns[0].model == main]
        agents = [b for b in roots if offers_tools(b.turns[0].history)]
        root = lineage_key((agents or roots)[0].prompt) if roots else None
        kinds = {
            i: "main"
            if b.turns[0].model == main and lineage_key(b.prompt) == root
            else "subagent"
            if b.turns[0].model == main
            else "side"
            for i, b in recorded
        }
        found: dict[int, tuple[str, int | None]] = {}
        for i, branch in recorded:
            before = [
                (t.created, j)
                for j, b in recorded
                if kinds[j] == "main" and j != i
                for t in b.turns
                if t.created <= branch.turns[0].created
            ]
            found[i] = (kinds[i], None if kinds[i] == "main" or not before else max(before)[1])
        return found

    def build_samples(self) -> list[Sample]:
        """One validated Sample per branch with at least one recorded turn, each whole: the template's
        fields, the recorded tokens, ``metadata.branch`` of ``metadata.branches``, the ``model`` its
        calls named, its ``lineage`` (``lineages``) with its ``parent`` branch, and ``side_call``: not of
        the main lineage, which the episode's Sample skips (``Sessions.episode``)."""
        meta = {**self.template.metadata, **self.metadata, "expired": self.expired}
        truncated = self.finished_by_agent is False or self.expired
        base = dataclasses.replace(
            self.template,
            reward=self.reward,
            session_id=self.id,
            status=Sample.Status.TRUNCATED if truncated else Sample.Status.COMPLETED,
        )
        recorded = [(i, branch) for i, branch in enumerate(self.branches) if branch.turns]
        lineages = self.lineages()
        samples = []
        for i, branch in recorded:
            lineage, parent = lineages[i]
            base.metadata = {
                **meta,
                "branch": i,
                "branches": len(recorded),
                "model": branch.turns[0].model,
                "lineage": lineage,
                "parent": parent,
                "side_call": lineage != "main",
            }
            sample = branch.to_sample(base)
            if self.script is not None:
                sample.rollout_log_probs = None
                sample.metadata["scripted"] = True
            samples.append(sample)  # validated where it enters: the buffer
        return samples


class Sessions:
    """The live and recently finished sessions, by id and by token, with idle expiry."""

    def __init__(self, *, idle_timeout: float, retention: float, max_turns: int = 0, max_sessions: int = 1 << 14):
        self.idle_timeout = idle_timeout
        self.retention = retention
        self.max_turns = max_turns
        self.max_sessions = max_sessions
        self.by_id: dict[str, Session] = {}
        self.by_token: dict[str, Session] = {}
        self.counts = {"created": 0, "finished": 0, "expired": 0}

    def make_room(self, count: int) -> None:
        """Room for ``count`` new sessions within ``max_sessions``: the finished sessions kept longest
        are forgotten first; if open ones alone fill it, 429 (``count`` opens all or none)."""
        excess = len(self.by_id) + count - self.max_sessions
        if excess <= 0:
            return
        finished = sorted((s for s in self.by_id.values() if s.finished), key=lambda s: s.last_active)
        if len(finished) < excess:
            raise InvalidRequest(
                f"the proxy holds its maximum of {self.max_sessions} sessions (--proxy-max-sessions), "
                f"{len(self.by_id) - len(finished)} of them open: finish some, or retry later",
                code="too_many_sessions",
                status=429,
            )
        for session in finished[:excess]:
            del self.by_id[session.id], self.by_token[session.token]

    def create(
        self,
        metadata: dict[str, Any],
        overrides: dict[str, Any] | None = None,
        template: Sample | None = None,
        script: list[list[int]] | None = None,
    ) -> Session:
        session = Session(metadata, overrides, self.max_turns, template, script)
        self.by_id[session.id] = session
        self.by_token[session.token] = session
        self.counts["created"] += 1
        return session

    def get(self, session_id: str) -> Session:
        session = self.by_id.get(session_id)
        if session is None:
            raise InvalidRequest(
                f"session {session_id!r} not found (never created, or finished more than {self.retention:.0f}s ago)",
                code="session_not_found",
                status=404,
            )
        return session

    def finish(self, session: Session, *, expired: bool = False) -> list[Sample]:
        if not session.finished:
            self.counts["expired" if expired else "finished"] += 1
        session.touch()
        return session.finish(expired=expired)

    def sweep(self, now: float | None = None) -> None:
        """Finish sessions idle past the timeout (kept, not lost); forget finished ones past retention."""
        now = time.time() if now is None else now
        for session in list(self.by_id.values()):
            idle = now - session.last_active
            if not session.finished and session.inflight == 0 and idle > self.idle_timeout:
                self.finish(session, expired=True)
            elif session.finished and idle > self.retention:
                del self.by_id[session.id], self.by_token[session.token]

    @staticmethod
    def episode(samples: list[Sample], side_calls: bool = False) -> list[Sample]:
        """The episode's Sample: the last branch of the main lineage, whose final turn the reward judged
        (``side_calls``: the last branch of any lineage)."""
        main = [s for s in samples if side_calls or not s.metadata.get("side_call")]
        return main[-1:]

    @property
    def active(self) -> int:
        return sum(not s.finished for s in self.by_id.values())
