"""The module map of STYLE.md, enforced: every ``inverted`` import (lazy ones too) must be allowed.

Two deliberate changes to the map: ``types`` may import ``errors`` (a leaf that imports nothing), so
that ``Sample.validate`` raises the tree's ``SampleError`` instead of a twin exception; and
``http_client`` (the retrying HTTP base under every client module) counts as shared, so that the
buffer's and SGLang's clients use one retry mechanism; and ``hf_checkpoint`` (what a Hugging Face
checkpoint's config says) counts as shared, so the engine and the trainer read an architecture in one
place; and ``weight_wire`` (SGLang's bucket, payload and update-group formats) counts as shared, so the
trainer's sender and the engine's receiver use one definition; and ``processes`` (children that die with
their parent, ``ManagedProcess``, free ports, one app on several processes) counts as shared and may
raise the tree's errors, so the rollout servers, the job's services and the buffer's workers start and
watch children one way; and ``auth`` (the API-key rule, compared in constant time) and ``limits`` (what
one request may cost: body size, text that cannot fit a context) count as shared, so the engine, the
proxy and the buffer check keys and bound requests one way; and ``peft_adapter`` (PEFT's LoRA adapter
format: config, names, directory) counts as shared, so the trainer's writer and the engine's reader use
one definition, and checks tensors as ``weight_wire`` does (``non_finite``); and ``plugins`` (the
loader, with its registry of other frameworks' forms) may read ``config`` (the rollout function's
context carries its config section), and the controller checks the buffer's plug-ins
(``buffer.filters``) before starting it; and ``compat`` (other frameworks' plug-in APIs) is an adapter
at the edge: it sits above every layer it adapts (it may import any of them), and nothing imports it but
the entry point, ``cli``, which fills the loader's registry with its forms in every process
(``test_only_the_entry_point_imports_compat``); and ``placement`` (Ray's side of starting servers) sits
beside the controller (a package of its own modules), which alone uses it, and the controller may read
prompt datasets (``buffer.datasets``) to check them and to evaluate, before and beside the buffer
service; and the embedded engine is a top-level package (``inverted.engine``), not a part of
``rollout``: it shares no code with the rollout side, which reaches it over HTTP exactly as it reaches
SGLang, so the only importer outside it is the CLI that serves it
(``test_the_engine_is_reached_only_over_http``); and ``devices`` (whether torch can see a GPU here,
without loading torch where it cannot) counts as shared, so the driver, the servers' launcher and the
trainer group decide one way; and ``view`` (``inverted view``: a run directory in the browser) reads
what the job left behind, read-only, through the two modules that own those files' formats,
``buffer.archive`` (the buffer's database) and ``train.details`` (the trainer's per-Sample log-probs),
never through a service, which may be gone; and each part's config section sits beside its owner
(``engine.config``, ``buffer.config``, ``train.config``, ``rollout.config``, ``rollout.proxy.config``,
``view.config``, and the composites ``controller.config`` and ``tinker.config``): a section module is
data (fields, help, checks) and imports only ``config``'s flag machinery and the sections a composite
holds, so the parts that run an owner (the controller, the Tinker service) and ``plugins`` (whose
plug-ins get a section in their context) may read it without reaching into the owner's code; and
``train.actor`` (the Ray edge of the trainer) reads each step's batch from the buffer through
``buffer.client``, by the reference the driver passes, so that the driver never relays Samples; the
rest of ``train/`` still knows nothing of the buffer.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "inverted"
SHARED = (
    "inverted.types",
    "inverted.errors",
    "inverted.config",
    "inverted.plugins",
    "inverted.metrics",
    "inverted.devices",
    "inverted.http_client",
    "inverted.hf_checkpoint",
    "inverted.weight_wire",
    "inverted.processes",
    "inverted.auth",
    "inverted.limits",
    "inverted.peft_adapter",
)

# the config sections beside their owners (data: fields, help, checks; see the docstring)
SECTIONS = (
    "inverted.engine.config",
    "inverted.buffer.config",
    "inverted.train.config",
    "inverted.rollout.config",
    "inverted.rollout.proxy.config",
    "inverted.view.config",
    "inverted.controller.config",
    "inverted.tinker.config",
)
SECTION_RULES = [(section, ("inverted.config", "inverted.types", "inverted.errors") + SECTIONS) for section in SECTIONS]

# module prefix -> prefixes it may import (besides itself); first match wins
RULES: list[tuple[str, tuple[str, ...]]] = [
    *SECTION_RULES,
    ("inverted.errors", ()),
    ("inverted.types", ("inverted.errors",)),
    ("inverted.config", ("inverted.types", "inverted.errors")),
    (
        "inverted.plugins",
        ("inverted.types", "inverted.errors", "inverted.config", "inverted.rollout.config", "inverted.train.config"),
    ),
    (
        "inverted.compat",
        tuple(
            f"inverted.{p.stem}"
            for p in PACKAGE.iterdir()
            if p.stem not in ("cli", "__init__", "__pycache__") and (p.suffix == ".py" or p.is_dir())
        ),
    ),
    ("inverted.metrics", ("inverted.errors",)),
    ("inverted.devices", ()),
    ("inverted.http_client", ("inverted.errors",)),
    ("inverted.hf_checkpoint", ("inverted.errors",)),
    ("inverted.weight_wire", ("inverted.errors",)),
    ("inverted.peft_adapter", ("inverted.errors", "inverted.hf_checkpoint", "inverted.weight_wire")),
    ("inverted.processes", ("inverted.errors",)),
    ("inverted.auth", ("inverted.errors",)),
    ("inverted.limits", ()),
    ("inverted.cli", ("inverted",)),
    (
        "inverted.controller",
        SHARED
        + (
            "inverted.controller",
            "inverted.buffer.config",
            "inverted.rollout.config",
            "inverted.train.config",
            "inverted.buffer.client",
            "inverted.buffer.datasets",
            "inverted.buffer.filters",
            "inverted.rollout.servers",
            "inverted.rollout.sglang_client",
            "inverted.rollout.proxy",
            "inverted.train.actor",
            "inverted.train.checkpoint",
            "inverted.placement",
        ),
    ),
    ("inverted.placement", SHARED + ("inverted.rollout.servers",)),
    ("inverted.tiny_model", SHARED),
    ("inverted.gguf_import", SHARED),  # like make-tiny-model: a checkpoint maker, beside the services
    ("inverted.engine", SHARED + ("inverted.engine",)),
    (
        "inverted.rollout",
        SHARED
        + (
            "inverted.buffer.client",
            "inverted.rollout.config",
            "inverted.rollout.sglang_client",
            "inverted.rollout.servers",
            "inverted.rollout.proxy",
            "inverted.rollout.chat",
        ),
    ),
    ("inverted.buffer", SHARED + ("inverted.buffer",)),
    ("inverted.view", SHARED + ("inverted.view", "inverted.buffer.archive", "inverted.train.details")),
    # a rank reads its step's batch from the buffer by reference (#77): the Ray edge of train/, through the client
    ("inverted.train.actor", SHARED + ("inverted.rollout.sglang_client", "inverted.train", "inverted.buffer.client")),
    ("inverted.train", SHARED + ("inverted.rollout.sglang_client", "inverted.train")),
    # the Tinker service: a front end on the trainer (its learner) and the rollout servers, like the job's controller
    (
        "inverted.tinker",
        SHARED
        + (
            "inverted.tinker",
            "inverted.rollout.config",
            "inverted.train.config",
            "inverted.buffer.store",
            "inverted.buffer.datasets",
            "inverted.rollout.servers",
            "inverted.rollout.sglang_client",
            "inverted.train.learner",
            "inverted.train.datum_losses",
            "inverted.train.parallel",
        ),
    ),
    ("inverted", ("inverted",)),
]


USER_PACKAGES = ("rollout_functions", "envs")  # user-side code shipped beside the package


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def inverted_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("inverted")}
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("inverted") and node.level == 0
        ):
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def allowed(module: str, target: str) -> bool:
    for prefix, allowed_prefixes in RULES:
        if module == prefix or module.startswith(prefix + "."):
            return any(target == a or target.startswith(a + ".") for a in allowed_prefixes)
    return False


def test_every_import_follows_the_module_map():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for target in inverted_imports(path):
            if not allowed(module, target):
                violations.append(f"{module} imports {target}")
    assert not violations, "\n".join(violations)


def test_the_engine_is_reached_only_over_http():
    importers = {
        module_name(p)
        for p in PACKAGE.rglob("*.py")
        if any(t.startswith("inverted.engine") for t in inverted_imports(p))
    }
    assert {m for m in importers if not m.startswith("inverted.engine")} <= {"inverted.cli"}


def test_the_checker_catches_a_forbidden_import():
    assert not allowed("inverted.buffer.store", "inverted.engine.model")
    assert not allowed("inverted.train.actor", "inverted.rollout.proxy")
    assert not allowed("inverted.train.trainer", "inverted.buffer.client")
    assert not allowed("inverted.types", "inverted.config")
    assert allowed("inverted.train.weight_sync", "inverted.rollout.sglang_client.SGLangClient")


USER_SIDE = {  # top-level packages of user-side code -> the inverted modules they may use
    "envs": (),  # an environment does not know it is trained
    "rollout_functions": (
        "inverted.types",
        "inverted.errors",
        "inverted.plugins",
        "inverted.rollout.proxy.client",
        "inverted.rollout.sglang_client",  # the services only through their clients
        "inverted.hf_checkpoint",  # load_tokenizer: the tokenizer with --chat-template, as the proxy renders
        "inverted.buffer.archive",
    ),  # a finished run's buffer, read-only (bootstrap learns from it)
}


def test_environments_and_rollout_functions_use_only_the_public_surface():
    violations = []
    for package, allowed_prefixes in USER_SIDE.items():
        for path in sorted((PACKAGE.parent / package).rglob("*.py")):
            for target in inverted_imports(path):
                if not any(target == a or target.startswith(a + ".") for a in allowed_prefixes):
                    violations.append(f"{package}/{path.name} imports {target}")
    assert not violations, "\n".join(violations)


def all_modules() -> dict[str, Path]:
    """Every module of the package and of the user-side packages beside it, by name."""
    paths = [
        *PACKAGE.rglob("*.py"),
        *(p for package in USER_PACKAGES for p in (PACKAGE.parent / package).rglob("*.py")),
    ]
    return {module_name(p): p for p in sorted(paths)}


def test_only_the_entry_point_imports_compat():
    """No core module (nor a rollout function or an environment) imports ``compat``, statically or lazily."""
    importers = {
        name
        for name, path in all_modules().items()
        if not name.startswith("inverted.compat")
        and any(t.startswith("inverted.compat") for t in inverted_imports(path))
    }
    assert importers <= {"inverted.cli"}, sorted(importers)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (lazily too), among ``all_modules``: an imported name that is
    not a module counts as its module; a package's ``__init__`` is the package."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in inverted_imports(path) | _user_imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _user_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in USER_PACKAGES:
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
