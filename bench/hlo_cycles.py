"""A step-time proxy from an optimized TPU HLO dump: XLA's own per-instruction ``estimated_cycles``, summed.

XLA's TPU compiler writes a cost-model estimate into each instruction it schedules
(``backend_config.window_config.estimated_cycles``); this sums them over the entry computation.
A ``while`` counts its body times its trip count and its condition once more: XLA's
``known_trip_count``, else inferred (the induction variable's constant start in the loop's
operand tuple, the condition's ``compare(iv, constant)``, plain or fused, the body's ``add(iv,
constant)``), else ``--dynamic-trip`` iterations (a data-dependent bound: tiled attention's
key-tile loops). A ``conditional`` counts one branch, every branch's cost noted: the last
(``lax.cond``'s true branch, which needle's chunked loss takes on the CPU whenever a chunk holds loss tokens)
or ``--branch max``. ``call`` and ``async-start`` count what they call; a fusion its own estimate.
Instructions without one (Pallas/Mosaic ``tpu_custom_call`` kernels such as splash attention,
async copies, scalar bookkeeping) count 0 and are listed with how often they run; ``--custom-call-us
splash_mha_fwd=642.5`` supplies a measured time for custom calls whose name starts with the
prefix. Nothing models overlap: the total is a serial sum.

It is XLA's cost model, not a measurement. The clock, 1.5 GHz, is calibrated on an 8192^3 bf16
matmul compiled for a TPU v5e (9,557,312 estimated cycles: 6.4 ms, 88 % of the 197 TFLOP/s MXU
bound; 4096^3 at 97 %, so a faster clock would put that one above the peak). On four cases
measured on a TPU v5e (2026-12-07) the sum ranks them right but runs 1.3-2.04x above the measured
step time: matmul-bound fusions match within ~5 %, memory-bound ones are overestimated 1.5-4x.
Use it to compare two programs (a setting, a commit) and see where the estimate goes.

    python -m bench.hlo_cycles FILE.hlo.txt [--clock-ghz 1.5] [--top 25] [--json OUT]
                               [--custom-call-us PREFIX=US ...] [--branch last|max|first] [--dynamic-trip 2.0]

FILE: ``compiled.as_text()`` of a program compiled for a TPU; bench/aot.py writes one (``--cycles``).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLOCK_GHZ = 1.5
INSTR_RE = re.compile(r"^\s+(ROOT )?%([^\s=]+) = ")
HEAD_RE = re.compile(r"^(ENTRY )?%([^\s(]+) ")
# Ops that cost nothing of their own (or whose cost is what they enclose): not listed as unestimated.
ZERO_OK = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
           "after-all", "partition-id", "replica-id", "opt-barrier"}  # fmt: skip
# What the induction variable passes through between the loop tuple and its compare or add.
PASS_THROUGH = ("copy", "bitcast", "convert", "reshape")


@dataclass
class Instr:
    """One HLO instruction: ``%name = type opcode(operands), attrs``."""

    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    cycles: int | None
    line: str

    def attr(self, key: str) -> str | None:
        """An unquoted attribute (``calls=%f`` -> ``f``), None where absent."""
        m = re.search(r"(?:^|, )" + re.escape(key) + r"=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    def quoted(self, key: str) -> str:
        """A quoted attribute (``op_name``, ``custom_call_target``), "" where absent."""
        m = re.search(re.escape(key) + r'="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclass
class Computation:
    name: str
    entry: bool
    instrs: list[Instr] = field(default_factory=list)
    by_name: dict[str, Instr] = field(default_factory=dict)
    root: Instr | None = None

    def through(self, name: str) -> Instr | None:
        """The instruction ``name`` is, past copies, bitcasts, converts and reshapes."""
        ins = self.by_name.get(name)
        while ins is not None and ins.opcode in PASS_THROUGH:
            ins = self.by_name.get(ins.operands[0])
        return ins


@dataclass
class HloModule:
    computations: dict[str, Computation]
    entry: Computation


def _balanced(s: str, i: int) -> int:
    """Index just past the parenthesised group that starts at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j + 1
    return len(s)


def _instr(text: str) -> tuple[Instr, bool]:
    """One instruction's text -> (the instruction, whether it is its computation's ROOT)."""
    m = INSTR_RE.match(text)
    assert m is not None
    rest = text[m.end():]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")  # a tuple type holds spaces
    typ, rest = re.sub(r"/\*index=\d+\*/", "", rest[:end]), rest[end:].lstrip()
    p = rest.index("(")
    e = _balanced(rest, p)
    operands = re.findall(r"%([\w.\-]+)", rest[p + 1 : e - 1])  # names, in order (a constant's literal is none)
    attrs = rest[e:].lstrip(", ")
    cycles = re.search(r'"estimated_cycles":"(\d+)"', attrs)
    return Instr(m.group(2), typ, rest[:p], operands, attrs, int(cycles.group(1)) if cycles else None, text), bool(m.group(1))


def parse_hlo(text: str) -> HloModule:
    """The computations of an HLO module's text and their instructions. An instruction may span
    lines (a Pallas ``tpu_custom_call`` carries its kernel's metadata); a computation ends at a
    line that is ``}`` alone."""
    comps: dict[str, Computation] = {}
    cur: Computation | None = None
    pending: list[str] = []

    def flush() -> None:
        if pending and cur is not None:
            ins, is_root = _instr("\n".join(pending))
            cur.instrs.append(ins)
            cur.by_name[ins.name] = ins
            cur.root = ins if is_root else cur.root
        pending.clear()

    for line in text.splitlines():
        if cur is None:
            m = HEAD_RE.match(line)
            if m and line.rstrip().endswith("{"):
                cur = comps[m.group(2)] = Computation(m.group(2), bool(m.group(1)))
        elif line.rstrip() == "}":
            flush()
            cur = None
        elif INSTR_RE.match(line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line)
    entry = next((c for c in comps.values() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation: not an HLO module's text")
    return HloModule(comps, entry)


def _const(ins: Instr | None) -> int | None:
    m = re.search(r"constant\((-?\d+)\)", ins.line) if ins is not None and ins.opcode == "constant" else None
    return int(m.group(1)) if m else None


def _side(comp: Computation, name: str, outer: tuple[Computation, list[str]] | None) -> tuple[str, Any]:
    """One operand of the loop's compare: ("const", value), ("iv", tuple index) or ("?", what)."""
    ins = comp.through(name)
    if ins is not None and ins.opcode == "parameter" and outer is not None:  # inside a fusion: its operand
        index = int(re.search(r"parameter\((\d+)\)", ins.line).group(1))  # type: ignore[union-attr]
        return _side(outer[0], outer[1][index], None)
    if ins is not None and ins.opcode == "constant":
        return "const", _const(ins)
    if ins is not None and ins.opcode == "get-tuple-element":
        return "iv", int(ins.attr("index") or 0)
    return "?", None if ins is None else ins.opcode


def _step(module: HloModule, body: Computation, index: int) -> int | None:
    """The constant the body adds to tuple element ``index`` (plain, or as the root of a fusion)."""
    if body.root is None or body.root.opcode != "tuple":
        return None
    nxt = body.through(body.root.operands[index])
    comp = body
    if nxt is not None and nxt.opcode == "fusion":
        comp = module.computations[nxt.attr("calls") or ""]
        nxt = comp.root
    if nxt is None or nxt.opcode != "add":
        return None
    return next((v for o in nxt.operands if (v := _const(comp.by_name.get(o))) is not None), None)


def count_iterations(start: int, step: int, direction: str, bound: int) -> int | None:
    """How many times ``iv = start; while iv <direction> bound: iv += step`` runs its body."""
    if step < 0:  # counting down: the same loop over the negated values
        start, step, bound = -start, -step, -bound
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    if step == 0 or direction not in ("LT", "LE", "NE"):
        return None
    return max(0, (bound - start) // step + 1 if direction == "LE" else -(-(bound - start) // step))


def infer_trip_count(module: HloModule, parent: Computation, loop: Instr) -> tuple[int | None, str]:
    """A while loop's trip count (None where its bound is not a constant) and how it was found."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if m:
        return int(m.group(1)), "known_trip_count"
    cond = module.computations[loop.attr("condition") or ""]
    if cond.root is None:
        return None, "no condition root"
    cmp, comp, outer = cond.root, cond, None
    if cmp.opcode == "fusion":  # XLA often fuses the compare: read the fused computation
        comp = module.computations[cmp.attr("calls") or ""]
        cmp, outer = comp.root, (cond, cond.root.operands)
    if cmp is None or cmp.opcode != "compare":
        return None, f"condition root {cmp.opcode if cmp else None}"
    direction = cmp.attr("direction") or "?"
    a, b = (_side(comp, o, outer) for o in cmp.operands[:2])
    if a[0] == "const" and b[0] == "iv":  # constant first: read it the other way round
        a, b = b, a
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    if a[0] != "iv":
        return None, f"condition {a} {direction} {b}"
    index = a[1]
    start, note = None, "inferred"
    tup = parent.by_name.get(loop.operands[0])
    if tup is not None and tup.opcode == "tuple":
        start = _const(parent.through(tup.operands[index]))
    if start is None:
        start, note = 0, "start assumed 0"
    step = _step(module, module.computations[loop.attr("body") or ""], index)
    if step is None:
        step, note = 1, note + ", step assumed 1"
    if b[0] != "const":
        return None, f"bound not constant ({b[0]} {b[1]}); {note}: start {start} step {step}"
    n = count_iterations(start, step, direction, b[1])
    return n, f"{note}: iv[{index}] from {start} step {step} {direction} {b[1]}"


def categorize(ins: Instr, module: HloModule) -> str:
    """What kind of work an instruction is: conv/dot fusion, loop fusion (reduce), loop fusion,
    copy/transpose, custom-call, other."""
    if ins.opcode == "fusion":
        kind = ins.attr("kind") or ""
        fused = module.computations.get(ins.attr("calls") or "")
        ops = {i.opcode for i in fused.instrs} if fused else set()
        if ops & {"convolution", "dot"} or kind == "kOutput":
            return "conv/dot fusion"
        if "custom-call" in ops:
            return "custom-call fusion"
        if kind == "kLoop" and "transpose" in ops and ops <= {"parameter", "transpose", "bitcast", "copy", "convert"}:
            return "copy/transpose"
        if "reduce" in ops or kind == "kInput":
            return "loop fusion (reduce)"
        return "loop fusion" if kind == "kLoop" else f"fusion {kind}"
    if ins.opcode == "custom-call":
        return "custom-call"
    if ins.opcode in ("copy", "transpose", "copy-start", "copy-done"):
        return "copy/transpose"
    return "conv/dot fusion" if ins.opcode in ("convolution", "dot") else "other"


def describe_shapes(ins: Instr, comp: Computation, n: int = 4) -> str:
    """``out <- (operand, ...)`` without layouts, the first ``n`` operands."""
    strip = lambda t: re.sub(r"\{[^}]*\}", "", t)  # noqa: E731
    ops = [strip(comp.by_name[o].type) if o in comp.by_name else "?" for o in ins.operands[:n]]
    more = f", +{len(ins.operands) - n}" if len(ins.operands) > n else ""
    return f"{strip(ins.type)} <- ({', '.join(ops)}{more})"


def estimate_cycles(
    module: HloModule, clock_ghz: float = CLOCK_GHZ, dynamic_trip: float = 2.0, branch: str = "last",
    custom_call_us: dict[str, float] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The serial sum of ``estimated_cycles`` over one execution of the entry computation.

    Returns ``total_cycles``, ``seconds`` (at ``clock_ghz``), ``categories`` (cycles by kind),
    ``top`` (every estimated instruction with its executions and total, largest first), ``loops``
    (trip counts and how each was found), ``unestimated`` (executions of instructions without an
    estimate, by opcode and custom-call target) with ``unestimated_examples``, and ``notes``."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    loops: list[dict[str, Any]] = []
    unestimated: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    notes: list[str] = []

    def walk(comp: Computation, mult: float, record: bool = True) -> float:
        total = 0.0
        for ins in comp.instrs:
            if ins.opcode == "while":
                n, how = infer_trip_count(module, comp, ins)
                trips: float = n if n is not None else dynamic_trip
                if n is None:
                    how = f"DYNAMIC, assumed {dynamic_trip} per execution: {how}"
                body = walk(module.computations[ins.attr("body") or ""], mult * trips, record)
                total += body + walk(module.computations[ins.attr("condition") or ""], mult * (trips + 1), record)
                if record:
                    loops.append({"while": ins.name, "in": comp.name, "trip": trips, "how": how, "mult": mult,
                                  "body_cycles_per_iter": round(body / (mult * trips)) if mult * trips else 0,
                                  "op_name": ins.quoted("op_name")})  # fmt: skip
                continue
            if ins.opcode == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                # Ordered as the index form is (lax.cond's false branch first, true last).
                names = [x.strip().lstrip("%") for x in m.group(1).split(",")] if m else \
                    [n for n in (ins.attr("false_computation"), ins.attr("true_computation")) if n]  # fmt: skip
                costs = [walk(module.computations[b], 1, record=False) for b in names]  # priced, not recorded
                pick = {"max": max(range(len(costs)), key=costs.__getitem__), "last": len(costs) - 1, "first": 0}[branch]
                if record and max(costs) > 0:
                    notes.append(f"conditional {ins.name}: branches {[round(c) for c in costs]} cycles, took {branch} (x{mult:g})")
                total += walk(module.computations[names[pick]], mult, record)
                continue
            called = ins.attr("to_apply") or ins.attr("calls")
            if ins.opcode in ("call", "async-start") and called:
                total += walk(module.computations[called], mult, record)
                continue
            cycles = ins.cycles
            if cycles is None and custom_call_us and ins.opcode == "custom-call":
                us = next((t for prefix, t in custom_call_us.items() if ins.name.startswith(prefix)), None)
                cycles = None if us is None else round(us * clock_ghz * 1e3)
            if cycles is None:
                if record and ins.opcode not in ZERO_OK:
                    key = ins.opcode + (f":{t}" if (t := ins.quoted("custom_call_target")) else "")
                    unestimated[key] += mult
                    if len(examples[key]) < 3:
                        examples[key].append(describe_shapes(ins, comp))
                continue
            if record:
                row = rows.setdefault((comp.name, ins.name), {
                    "name": ins.name, "computation": comp.name, "opcode": ins.opcode, "cycles": cycles, "count": 0.0,
                    "kind": ins.attr("kind") or ins.quoted("custom_call_target"), "category": categorize(ins, module),
                    "shapes": describe_shapes(ins, comp), "op_name": ins.quoted("op_name")})  # fmt: skip
                row["count"] += mult
            total += cycles * mult
        return total

    total = walk(module.entry, 1)
    top = sorted(rows.values(), key=lambda r: -r["cycles"] * r["count"])
    categories: collections.Counter[str] = collections.Counter()
    for r in top:
        r["count"] = round(r["count"], 3)
        r["total_cycles"] = r["cycles"] * r["count"]
        categories[r["category"]] += r["total_cycles"]
    return {"total_cycles": total, "seconds": total / (clock_ghz * 1e9), "clock_ghz": clock_ghz, "branch": branch,
            "dynamic_trip": dynamic_trip, "categories": dict(categories.most_common()), "top": top, "loops": loops,
            "unestimated": dict(unestimated.most_common()), "unestimated_examples": dict(examples), "notes": notes}  # fmt: skip


def shorten_op_name(op_name: str, n: int = 70) -> str:
    """A needle train step's op_name, its common parts abbreviated, cut to its last ``n`` characters."""
    s = op_name.replace("jit(train_step)/", "").replace("Transformer._scanned_layers/while/body/", "L/")
    s = s.replace("closed_call/", "").replace("transpose(jvp(Transformer))", "bwd").replace("jvp(Transformer)", "fwd")
    return s if len(s) <= n else "…" + s[-(n - 1) :]


def format_report(report: dict[str, Any], top: int = 25) -> str:
    """Total, loops, categories, what has no estimate, notes and the ``top`` instructions, as text."""
    ms = lambda c: c / (report["clock_ghz"] * 1e6)  # noqa: E731
    whole = max(report["total_cycles"], 1)
    lines = [f"total {report['total_cycles']:,.0f} cycles = {report['seconds'] * 1e3:.1f} ms at {report['clock_ghz']} GHz "
             "(XLA's estimate, a serial sum)", "loops:"]  # fmt: skip
    for lp in report["loops"]:
        lines.append(f"  {lp['while']:<12} trip {lp['trip']!s:>4} x outer {lp['mult']:<5g} {lp['body_cycles_per_iter']:>12,} "
                     f"cyc/iter  ({lp['how']})  {shorten_op_name(lp['op_name'], 60)}")  # fmt: skip
    lines.append("categories:")
    lines += [f"  {k:<20} {ms(v):8.1f} ms  {100 * v / whole:5.1f}%" for k, v in report["categories"].items()]
    if report["unestimated"]:
        lines.append("no estimate (counted 0), executions:")
        lines += [f"  {k:<40} x{v:g}  e.g. {report['unestimated_examples'][k][0][:110]}" for k, v in report["unestimated"].items()]
    lines += [f"note: {n}" for n in report["notes"][:10]]
    lines.append(f"top {top} instructions by total cycles:")
    lines.append(f"  {'ms':>7} {'%':>5} {'count':>5} {'cyc/exec':>9}  {'op/kind':<22} shapes | op_name")
    for r in report["top"][:top]:
        lines.append(f"  {ms(r['total_cycles']):7.2f} {100 * r['total_cycles'] / whole:5.1f} {r['count']:>5g} {r['cycles']:>9,}  "
                     f"{(r['opcode'] + ':' + r['kind'])[:22]:<22} {r['shapes'][:120]} | {shorten_op_name(r['op_name'])}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", type=Path, help="an optimized TPU HLO module's text (compiled.as_text(), bench.aot's .hlo.txt)")
    ap.add_argument("--clock-ghz", type=float, default=CLOCK_GHZ, help="cycles per second the estimate runs at (v5e: 1.5)")
    ap.add_argument("--top", type=int, default=25, help="instructions listed (and kept in --json)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the report as JSON")
    ap.add_argument("--custom-call-us", action="append", default=[], metavar="PREFIX=US",
                    help="a time a call for custom calls (Pallas kernels have no estimate) whose instruction name "
                         "starts with PREFIX, e.g. splash_mha_fwd=642.5")  # fmt: skip
    ap.add_argument("--branch", choices=["last", "max", "first"], default="last",
                    help="the conditional branch counted: last = lax.cond's true branch")
    ap.add_argument("--dynamic-trip", type=float, default=2.0,
                    help="iterations per execution of a loop with a data-dependent bound (bench.accelerator's packed "
                         "batch at T=1024 in 256-blocks visits 1, 2, 3, 2 key tiles: 2.0)")  # fmt: skip
    args = ap.parse_args(argv)
    if bad := [x for x in args.custom_call_us if not re.fullmatch(r"[^=]+=[0-9.]+", x)]:
        ap.error(f"--custom-call-us takes PREFIX=MICROSECONDS, got {bad[0]!r}")
    custom = {k: float(v) for k, _, v in (x.partition("=") for x in args.custom_call_us)}
    report = estimate_cycles(parse_hlo(args.hlo.read_text()), args.clock_ghz, args.dynamic_trip, args.branch, custom)
    print(format_report(report, args.top))
    if args.json:
        args.json.write_text(json.dumps({**report, "hlo": str(args.hlo), "top": report["top"][: args.top]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
