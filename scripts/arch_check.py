"""Measures the architecture rules of docs/architecture.md on the source tree.

Prints: import circles, imports that run from a lower layer up to a higher one, capability probes
(getattr/hasattr on a model or model class) outside ``models/``, family names in code outside ``models/``
and ``testing/`` (comments, docstrings and help texts aside), files over 400 lines and the length of
``Engine.step`` and the docs that are maps over their size. ``--strict`` exits 1 when a rule has more findings than it allows (`ALLOWED`, else none);
tests/unit/test_architecture.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mmserve"

# lowest first; a module may import its own layer or a lower one
LAYERS = [
    {"core", "sampling_params", "config"},
    {"kernels"},
    {"distributed"},
    {"attention"},
    {"layers"},
    {"multimodal.placeholder_expansion", "multimodal.media_limits"},
    {"models", "lora"},
    {"multimodal"},
    {"worker"},
    {"engine"},
    {"llm", "entrypoints", "serving_ray", "bench", "testing", "quantize", "__init__"},
]
FAMILY_WORDS = re.compile(
    r"llava|qwen2|qwen|blip|mllama|fuyu|kosmos|nougat|pix2struct|pixtral|persimmon|onevision|"
    r"\bt5\b|mbart|donut|vila|neva|cogvlm|internlm|xcomposer",
    re.I,
)
PROBED = re.compile(
    r"^(self\.)?(runner\.)?(model|model_cls|cls|language_model)(\.language_model)?$"
)
MAX_LINES = 400
MAX_STEP_LINES = 25
DOC_LINES = {
    "docs/architecture.md": 250,
    "docs/benchmarks.md": 250,
}  # maps, not logs (docs/lab/ has those)
# findings allowed per rule (the bar: a handful of family names, e.g. a default family)
ALLOWED = {"upward imports": 3, "family names outside models/ and testing/": 5}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or "__init__"


def layer_of(mod: str) -> int:
    best, best_len = len(LAYERS) - 1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for type checkers only; they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node))
    return out


def imports_of(tree: ast.AST, mod: str, top_level_only: bool) -> set[str]:
    """The mmserve modules `mod` imports: at import time (`top_level_only`) or anywhere it runs."""
    out: set[str] = set()
    skip = _type_checking_nodes(tree)
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if id(node) in skip or (isinstance(node, ast.If) and top_level_only):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("mmserve."):
                base = node.module[len("mmserve.") :]
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists() else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mmserve."):
                    out.add(alias.name[len("mmserve.") :])
    return out


def code_tokens(source: str) -> list[tokenize.TokenInfo]:
    """Names and string literals, without comments and docstrings."""
    tree = ast.parse(source)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.keyword) and node.arg == "help":
            doc_lines.update(range(node.value.lineno, node.value.end_lineno + 1))
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return [
        t
        for t in toks
        if t.type in (tokenize.NAME, tokenize.STRING) and t.start[0] not in doc_lines
    ]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def measure() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {
        "import circles": [],
        "upward imports": [],
        "capability probes outside models/": [],
        "family names outside models/ and testing/": [],
        f"files over {MAX_LINES} lines": [],
        f"Engine.step over {MAX_STEP_LINES} lines": [],
        "docs over their size": [],
    }
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        mod = module_name(path)
        rel = str(path.relative_to(ROOT.parent))
        graph[mod] = {m for m in imports_of(tree, mod, True) if m != mod}
        for dep in sorted(imports_of(tree, mod, False)):
            if layer_of(dep) > layer_of(mod) and layer_of(mod) != len(LAYERS) - 1:
                found["upward imports"].append(f"{rel}: {dep}")
        lines = source.count("\n")
        if lines > MAX_LINES:
            found[f"files over {MAX_LINES} lines"].append(f"{rel}: {lines}")
        top = mod.split(".")[0]
        if top != "models":
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and node.args
                    and PROBED.match(ast.unparse(node.args[0]))
                ):
                    found["capability probes outside models/"].append(
                        f"{rel}:{node.lineno}: {ast.unparse(node)}"
                    )
        if top not in ("models", "testing"):
            for tok in code_tokens(source):
                if FAMILY_WORDS.search(tok.string):
                    found["family names outside models/ and testing/"].append(
                        f"{rel}:{tok.start[0]}: {tok.string[:60]}"
                    )
        if mod == "engine.engine":
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name == "step":
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_STEP_LINES:
                        found[f"Engine.step over {MAX_STEP_LINES} lines"].append(f"{n} lines")
    found["import circles"] = [" -> ".join(c) for c in find_cycles(graph)]
    for doc, most in DOC_LINES.items():
        path = ROOT.parent / doc
        if path.is_file() and (n := path.read_text().count("\n")) > most:
            found["docs over their size"].append(f"{doc}: {n} lines (at most {most})")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 when any rule is broken")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every finding")
    args = ap.parse_args()
    found = measure()
    for rule, items in found.items():
        print(f"{rule}: {len(items)}")
        if args.verbose:
            for item in items:
                print(f"    {item}")
    broken = [rule for rule, items in found.items() if len(items) > ALLOWED.get(rule, 0)]
    if broken:
        print("over the limit: " + "; ".join(broken))
    return 1 if args.strict and broken else 0


if __name__ == "__main__":
    sys.exit(main())
