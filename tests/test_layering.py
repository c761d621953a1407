"""The layering table (DESIGN.md, "A test holds the layering table"): which kvserve folder may import
which, and which may import torch. Lower floors never import upper ones:

    leaves       kv, kernels, structured, tool_calls, answer_cache, memory_probe (no kvserve import)
    config       -> kv
    model floor  attention -> kernels, config, kv;  model -> kernels, config, attention;  sample -> structured, ...
    runner       worker -> the model floor;  spec_decode, distributed -> worker and below
    core         engine -> kv, worker, sample.params, spec_decode, distributed, structured, config (no torch);
                 pooling -> engine and below
    text         outputs, frontend (chat templates too), llm, the package's __init__
    serving      server -> frontend, engine, pooling, ...;  fleet -> server, ...
    commands     bench, analysis, quality, entrypoints (generate, chat, serve), cli

The graph is test_layout's (every import statement, lazy ones too, none under `if TYPE_CHECKING:`,
which is where "types only" imports go). A node is a folder (kvserve/engine) or a top-level module
(kvserve/llm.py), as in test_layout.folder. ALLOWED gives each node the names it may import: a folder
("sample": all of kvserve/sample) or one module ("sample.params": that module only). An edge the
table refuses that exists today is a DEBT, listed module by module with what is wrong and what
removes it; the test fails on an edge that is neither allowed nor listed, and on a listed debt
that is gone (delete its line), so the list only shrinks. A node of the table that does not exist
yet (none today) costs nothing; a node that exists and is not in the table fails."""
from __future__ import annotations

import ast

from tests.test_layout import cycles, folder, import_graph, imported_names, modules

# -- the table ---------------------------------------------------------------------------------------
# node -> the kvserve names it may import (short names: "kv" is kvserve.kv, "kvserve" the package's
# __init__ itself). Its own folder is always allowed.
ALLOWED: dict[str, set[str]] = {
    # leaves: bookkeeping and kernels that know no other kvserve folder
    "kv": set(),                    # block pool, prefix caches, manager, tiers: ints and bytes, no requests
    "kernels": set(),               # kvserve's C++ ops
    "structured": set(),            # grammar compilation and matchers
    "tool_calls": set(),            # tool prompts and readers
    "answer_cache": set(),          # answer caches (exact, semantic)
    "memory_probe": set(),          # KVSERVE_MEMORY_PROBE sampling
    # config: sections and flags, resolved once
    "config": {"kv"},               # kv.tiers parses --kv-tiers
    # the model floor
    "attention": {"kernels", "config", "kv"},        # backends over the paged cache (block ids)
    "model": {"kernels", "config", "attention"},     # never kv, engine, worker
    "sample": {"structured", "kernels", "config"},   # logits -> tokens, the grammar mask
    # the runner floor
    "worker": {"model", "attention", "kernels", "kv", "sample", "structured", "config"},
    "spec_decode": {"worker", "model", "attention", "kernels", "kv", "sample", "structured", "config"},
    "distributed": {"worker", "model", "attention", "kernels", "kv", "sample", "structured", "config"},
    # the core: token ids in, token deltas out; no model, no tensors, no text
    "engine": {"kv", "worker", "sample.params", "spec_decode", "distributed", "structured", "config",
               "memory_probe"},
    "pooling": {"engine", "worker", "model", "attention", "kernels", "kv", "sample", "config"},
    # text: chat rendering, tokenize, detokenize, the offline API
    "outputs": {"engine", "sample"},                 # RequestOutput carries the request's metrics
    "frontend": {"engine", "kv", "model", "sample", "structured", "config", "outputs",
                 "tool_calls"},                      # model: its tokenizers
    "llm": {"frontend", "outputs", "sample", "config"},
    "kvserve": {"llm", "outputs", "frontend", "sample", "config"},      # the public API
    # serving
    "server": {"frontend", "engine", "pooling", "sample", "structured", "config", "outputs", "answer_cache",
               "tool_calls", "memory_probe"},
    "fleet": {"server", "kv", "model", "config", "frontend", "tool_calls"},   # tokenizers, chat templates
    # tools and commands
    "bench": {"kvserve", "llm", "outputs", "model", "sample", "config"},         # model: tokenizers
    "analysis": {"kvserve", "llm", "outputs", "sample", "config", "quality"},
    "quality": {"kvserve", "llm", "outputs", "sample", "config"},       # perplexity, KL divergence
    "entrypoints": {"kvserve", "llm", "outputs", "bench", "frontend", "config", "sample", "server",
                    "fleet"},                        # generate, chat, serve
    "cli": {"entrypoints", "analysis", "quality", "fleet", "server", "config"},    # config: the parser class
}

# The nodes that may import torch (lazily too): where tensors are computed. Not engine, config, kv,
# frontend, server, fleet, tool_calls, bench nor the top-level API and command modules.
TORCH_ALLOWED = {"kernels", "attention", "model", "sample", "worker", "spec_decode", "distributed", "pooling",
                 "structured", "answer_cache", "analysis", "quality"}

# -- the debts ---------------------------------------------------------------------------------------
# (from module, to module or "torch"): edges the table refuses that exist today. Pay one, delete its line.
DEBTS: set[tuple[str, str]] = set()     # none left (issue 32 paid the last twelve)


# -- the checker -------------------------------------------------------------------------------------
def full(name: str) -> str:
    return name if name == "kvserve" else f"kvserve.{name}"


def short(name: str) -> str:
    return name.removeprefix("kvserve.")


def allows(entry: str, target: str) -> bool:
    """An entry of ALLOWED (full name) admits `target`: a folder or top-level module is the node
    itself; a deeper name is that module and the modules under it."""
    if entry.count(".") < 2:
        return folder(target) == entry
    return target == entry or target.startswith(entry + ".")


def torch_importers() -> set[str]:
    """The kvserve modules with an import of torch (or torch.x) outside `if TYPE_CHECKING:`."""
    out = set()
    for m, path in modules().items():
        for source, _ in imported_names(ast.parse(path.read_text(), str(path)), m, path.name == "__init__.py"):
            if source == "torch" or source.startswith("torch."):
                out.add(m)
    return out


def problems(graph: dict[str, set[str]], torch_users: set[str], allowed: dict[str, set[str]],
             torch_allowed: set[str], debts: set[tuple[str, str]]) -> list[str]:
    """What breaks the table: unknown nodes, refused edges not listed as debts, listed debts that are
    gone or that the table allows. Names in `allowed`, `torch_allowed` and `debts` are short."""
    table = {full(k): {full(e) for e in v} for k, v in allowed.items()}
    may_torch = {full(k) for k in torch_allowed}
    debts_full = {(full(a), b if b == "torch" else full(b)) for a, b in debts}
    out = [f"{short(n)} is not in the layering table (add its row to ALLOWED)"
           for n in sorted({folder(m) for m in graph} - set(table))]
    refused = set()
    for a in sorted(graph):
        entries = table.get(folder(a), set())
        for b in sorted(graph[a]):
            if folder(b) != folder(a) and not any(allows(e, b) for e in entries):
                refused.add((a, b))
    refused |= {(a, "torch") for a in torch_users if folder(a) not in may_torch}
    out += [f"{short(folder(a))} may not import {'torch' if b == 'torch' else short(folder(b))}: "
            f"{short(a)} -> {short(b) if b != 'torch' else b}" for a, b in sorted(refused - debts_full)]
    exists = {(a, b) for a in graph for b in graph[a]} | {(a, "torch") for a in torch_users}
    for a, b in sorted(debts_full - refused):
        why = "the table allows it (drop the line)" if (a, b) in exists else "it is gone (delete its line)"
        out.append(f"debt {short(a)} -> {short(b) if b != 'torch' else b}: {why}")
    return out


# -- the checker checks ------------------------------------------------------------------------------
TOY_ALLOWED = {"kv": set(), "engine": {"kv", "sample.params"}, "sample": set(), "model": set()}
TOY_GRAPH = {"kvserve.kv.pool": set(), "kvserve.kv": {"kvserve.kv.pool"},
             "kvserve.engine.core": {"kvserve.kv.pool", "kvserve.sample.params", "kvserve.engine.request"},
             "kvserve.engine.request": {"kvserve.sample.params"},
             "kvserve.sample.params": set(), "kvserve.sample.sampler": set(), "kvserve.model.llama": set()}


def toy(graph=None, torch_users=(), debts=(), allowed=None):
    allowed = TOY_ALLOWED if allowed is None else allowed
    return problems(TOY_GRAPH if graph is None else graph, set(torch_users), allowed, {"model"}, set(debts))


def test_the_checker_passes_a_graph_that_keeps_the_table():
    assert toy(torch_users={"kvserve.model.llama"}) == []
    assert toy(allowed={**TOY_ALLOWED, "attention": {"kv"}}) == []       # a node yet to come costs nothing


def test_the_checker_catches_a_forbidden_edge_and_its_debt_clears_it():
    g = {**TOY_GRAPH, "kvserve.kv.pool": {"kvserve.engine.request"}}
    assert toy(g) == ["kv may not import engine: kv.pool -> engine.request"]
    assert toy(g, debts={("kv.pool", "engine.request")}) == []


def test_a_module_entry_admits_that_module_only():
    g = {**TOY_GRAPH, "kvserve.engine.core": {"kvserve.sample.sampler", "kvserve.sample.params_x"}}
    assert toy(g) == ["engine may not import sample: engine.core -> sample.params_x",
                      "engine may not import sample: engine.core -> sample.sampler"]
    assert allows("kvserve.sample.params", "kvserve.sample.params.fields")
    assert allows("kvserve", "kvserve") and not allows("kvserve", "kvserve.llm")
    assert not allows("kvserve.llm", "kvserve.llm_x") and allows("kvserve.kv", "kvserve.kv")


def test_the_checker_catches_torch_where_it_is_refused():
    assert toy(torch_users={"kvserve.engine.request"}) == \
        ["engine may not import torch: engine.request -> torch"]
    assert toy(torch_users={"kvserve.engine.request"}, debts={("engine.request", "torch")}) == []


def test_the_checker_catches_a_stale_debt():
    assert toy(debts={("kv.pool", "engine.core")}) == ["debt kv.pool -> engine.core: it is gone (delete its line)"]
    assert toy(debts={("engine.request", "torch")}) == \
        ["debt engine.request -> torch: it is gone (delete its line)"]
    assert toy(debts={("engine.core", "kv.pool")}) == \
        ["debt engine.core -> kv.pool: the table allows it (drop the line)"]


def test_the_checker_catches_a_node_missing_from_the_table():
    g = {**TOY_GRAPH, "kvserve.newthing.x": set()}
    assert toy(g) == ["newthing is not in the layering table (add its row to ALLOWED)"]


def test_the_checker_sees_kvserves_torch_imports():
    users = torch_importers()
    assert "kvserve.model.llama" in users and "kvserve.analysis.specs" in users   # the latter lazily
    assert "kvserve.engine.scheduler" not in users


# -- the table itself --------------------------------------------------------------------------------
def test_the_table_is_a_direction():
    """No two nodes may import each other, through any chain of allowed entries."""
    g = {full(k): {folder(full(e)) for e in v} for k, v in ALLOWED.items()}
    for targets in list(g.values()):
        for t in targets:
            g.setdefault(t, set())
    assert cycles(g) == []


def test_the_rules_of_design_md():
    assert not {"server", "frontend", "fleet", "entrypoints", "model"} & ALLOWED["engine"]
    assert "engine" not in TORCH_ALLOWED and "kv" not in TORCH_ALLOWED
    assert ALLOWED["kv"] == set()
    assert not {"kv", "engine", "worker"} & ALLOWED["model"]


# -- kvserve -----------------------------------------------------------------------------------------
def test_kvserve_keeps_the_layering_table():
    found = problems(import_graph(), torch_importers(), ALLOWED, TORCH_ALLOWED, DEBTS)
    assert not found, "the layering table (tests/test_layering.py) is broken:\n  " + "\n  ".join(found)
