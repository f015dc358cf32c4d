"""The layering the *Packages and layering* table of docs/architecture.md states: each package imports only the
packages below it (imports inside functions included). Adding an import that runs back up the stack fails here."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "pagedlm"

# package (or top-level module) -> what it may import from pagedlm. Keep in step with docs/architecture.md.
LEAVES = {"cpu", "paths", "outputs", "__init__"}
ALLOWED = {
    "config": {"cpu"},
    "cbuild": {"cpu", "paths"},
    "hub": {"config", "paths"},
    "kvcache": {"config"},
    "attention": {"kvcache", "cbuild", "config"},
    "model": {"attention", "kvcache", "hub", "config", "cpu", "cbuild"},
    "sampling": {"outputs", "config", "cbuild"},
    "spec": {"kvcache"},
    "engine": {"model", "kvcache", "attention", "sampling", "hub", "config", "outputs", "cpu", "paths", "spec"},
    "dp": {"engine", "kvcache", "hub", "config"},
    "router": {"dp", "paths"},
    "server": {"router", "dp", "engine", "sampling", "config", "outputs", "__init__"},
    "llm": {"dp", "engine", "sampling", "config", "outputs"},
}
TOOLS = {"bench", "cli", "chat_repl"}  # the command line and benchmarks sit on top and may use anything
# The engine's contract with the layers above (protocol.py: requests in, output deltas out; errors.py) stands on its
# own, so the server and the replicas speak it without the engine's machinery; the server uses only that contract,
# the engine client and input processor it is given, and (to start engines) the engine loop classes and the
# embedding engine (an encoder on a thread of its own, outside the generation contract).
CONTRACT = {"engine/errors.py": set(), "engine/protocol.py": {"engine.errors", "outputs", "sampling.params"}}
SERVER_ENGINE_API = {"engine.client", "engine.protocol", "engine.errors", "engine.input_processor",
                     "engine.async_engine", "engine.llm_engine", "engine.embedding_engine"}
# The router is pure policy: of the replicas it uses only the placement policies (to balance a model's replicas),
# and those, with the dp package's __init__, import nothing from pagedlm, so routing never loads the engine.
ROUTER_DP_API = {"dp.placement"}
PURE = ("dp/__init__.py", "dp/placement.py")


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path, depth: int = 1) -> set[str]:
    """The pagedlm packages / top-level modules a file imports (relative imports are not used in this code); with
    `depth` 2, the modules inside the packages too (`engine.client`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "pagedlm":
                continue
            if len(parts) > 1:
                found.add(".".join(parts[1:1 + depth]))
            else:  # from pagedlm import X: X is a package or a name defined in pagedlm/__init__.py
                found.update(a.name if (SRC / a.name).exists() or (SRC / f"{a.name}.py").exists() else "__init__"
                             for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(".".join(a.name.split(".")[1:1 + depth]) for a in node.names
                         if a.name.startswith("pagedlm.") and len(a.name.split(".")) > 1)
    return found


FILES = sorted(p for p in SRC.rglob("*.py") if _unit(p) not in TOOLS)


def test_every_unit_has_a_rule():
    units = {_unit(p) for p in FILES}
    assert units <= set(ALLOWED) | LEAVES, units - set(ALLOWED) - LEAVES


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path):
    unit = _unit(path)
    allowed = ALLOWED.get(unit, set()) | {unit}
    if unit == "__init__":
        return  # the package's public names re-export from below
    bad = _imports(path) - allowed
    assert not bad, f"{path.relative_to(SRC)} ({unit}) imports {sorted(bad)}; allowed: {sorted(allowed - {unit})}"


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_the_engine_contract_imports_no_engine_internals(name: str):
    bad = _imports(SRC / name, depth=2) - CONTRACT[name] - {"__init__"}
    assert not bad, f"{name} imports {sorted(bad)}; allowed: {sorted(CONTRACT[name])}"


def test_the_server_uses_only_the_engine_contract():
    for path in sorted((SRC / "server").rglob("*.py")):
        engine = {m for m in _imports(path, depth=2) if m.split(".")[0] == "engine"}
        assert engine <= SERVER_ENGINE_API, f"{path.relative_to(SRC)} imports {sorted(engine - SERVER_ENGINE_API)}"


def test_the_router_uses_only_replica_placement():
    for path in sorted((SRC / "router").rglob("*.py")):
        dp = {m for m in _imports(path, depth=2) if m.split(".")[0] == "dp"}
        assert dp <= ROUTER_DP_API, f"{path.relative_to(SRC)} imports {sorted(dp - ROUTER_DP_API)}"


@pytest.mark.parametrize("name", PURE)
def test_replica_placement_imports_nothing(name: str):
    assert not _imports(SRC / name), f"{name} imports {sorted(_imports(SRC / name))}"


def test_importing_the_router_loads_no_engine():
    code = ("import sys, pagedlm.router; "
            "print(sorted(m for m in sys.modules if m.startswith(('pagedlm.engine', 'pagedlm.dp.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert out.stdout.strip() == "['pagedlm.dp.placement']", out.stdout + out.stderr


def test_the_check_sees_a_violation(tmp_path):
    """The scanner finds imports inside functions too (so the test above is not vacuous)."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from pagedlm.server.api import build_app\n    import pagedlm.router.policies\n")
    assert _imports(f) == {"server", "router"} and _imports(f, depth=2) == {"server.api", "router.policies"}


def test_the_endpoints_of_a_served_model_define_distinct_names():
    """`ServedModel` joins one class per endpoint (server/endpoints/) over `EndpointBase`, all on one object: a
    method two of them define would silently replace the other's."""
    defined: dict[str, str] = {}
    for path in sorted((SRC / "server" / "endpoints").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef) or not (
                    node.name == "EndpointBase" or any(getattr(b, "id", None) == "EndpointBase" for b in node.bases)):
                continue
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and not f.name.startswith("__"):
                    assert f.name not in defined, f"{node.name}.{f.name} also in {defined[f.name]}"
                    defined[f.name] = node.name
    assert {"EndpointBase", "CompletionsEndpoint", "ChatEndpoint", "TokenizeEndpoint"} <= set(defined.values())


def test_lint_is_clean():
    """ruff (the test extra has it; pyproject.toml's settings) finds nothing in src, tests and benchmarks."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this interpreter (pip install -e '.[test]')")
    root = SRC.parent.parent
    done = subprocess.run([str(ruff), "check", "--no-cache", "src", "tests", "benchmarks"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


MAX_FILE_LINES, MAX_CLASS_LINES = 400, 250  # the code's size rules (C++ kernels aside)


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"{text.count(chr(10))} lines"] if text.count("\n") > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
            found.append(f"class {node.name}: {n} lines")
    return found


def test_files_and_classes_stay_small():
    """No Python file over 400 lines and no class over 250, in the package and its tools."""
    over = {str(p.relative_to(SRC)): o for p in sorted(SRC.rglob("*.py")) if (o := _oversized(p))}
    assert not over, over


def test_the_size_check_sees_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES + "\n" * (MAX_FILE_LINES - MAX_CLASS_LINES))
    assert _oversized(f) == [f"{MAX_FILE_LINES + 1} lines", f"class Big: {MAX_CLASS_LINES + 1} lines"]
