"""The serve probe's verdict: stock and E2 compared request by request.

Every request's output token ids must agree exactly (in a concurrent case,
where the sides batch differently, up to a near tie: parted_at_a_near_tie),
every request must be
complete (its full ``max_tokens``), each case must have taken its path (a
prefix-cache hit, stock's preemptions; E2 preempting no more than stock and,
in the case of short requests, running more of them at once), and each side
must be what it claims (E2's boot report on E2 only). In the align mode E2's
tokens must also agree with E2's own engine run with prefix caching off,
which must take no prefix-cache hit. A row with a problem fails the probe;
async rows the engine turned off are skipped. The gate modes (serve_gate) add a
row for E2's prefix-cache hits against stock's, and fail on a CUDA error logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from e2.probes.serve_gate import GATE_MODES, REFERENCE_MODES, hit_problems
from e2.probes.serve_settings import ALL_MODES


def complete(request: dict, max_tokens: int) -> bool:
    ids = request.get("token_ids")
    return request.get("error") is None and isinstance(ids, list) and len(ids) == max_tokens


@dataclass
class Row:
    mode: str
    case: str
    requests: int
    complete: dict[str, int]                    # side -> complete requests
    output_tokens: dict[str, int]
    matched: int                                # requests whose token ids agree exactly
    exercised: dict[str, str]                   # side -> what the path counters say
    kv_lines: dict[str, str]
    skipped: str | None = None
    problems: list[str] = field(default_factory=list)
    # requests whose greedy tokens parted at a near tie (parted_at_a_near_tie)
    close: int = 0
    # E2 against itself with prefix caching off (align mode): "matched/requests"
    reference: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is not None or not self.problems

    @property
    def verdict(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "FAIL")


def compare(stock: dict, e2: dict) -> list[Row]:
    """Request-by-request, per mode and case; a row's problems make the probe fail."""
    rows = []
    for mode in (m for m in ALL_MODES if m in stock["modes"] or m in e2["modes"]):
        s_mode, e_mode = stock["modes"].get(mode, {}), e2["modes"].get(mode, {})
        kv = {side: m.get("engine", {}).get("kv_line", "") for side, m in
              (("stock", s_mode), ("e2", e_mode))}
        problems = _identity(mode, s_mode, e_mode)
        skipped = s_mode.get("skipped") or e_mode.get("skipped")
        if skipped:
            if bool(s_mode.get("skipped")) != bool(e_mode.get("skipped")):
                problems.append("one side ran async scheduling, the other did not")
            rows.append(Row(mode, "(all)", 0, {}, {}, 0, {}, kv, skipped, problems))
            continue
        names = list(dict.fromkeys([*s_mode.get("cases", {}), *e_mode.get("cases", {})]))
        for name in names:
            s_case, e_case = s_mode["cases"].get(name), e_mode["cases"].get(name)
            if s_case is None or e_case is None:
                rows.append(Row(mode, name, 0, {}, {}, 0, {}, kv, None,
                                [f"only on {'stock' if e_case is None else 'e2'}"]))
                continue
            row = _compare_case(mode, name, s_case, e_case, kv)
            if "no_prefix_caching" in e_mode:
                _compare_reference(row, e_case, e_mode["no_prefix_caching"])
            row.problems[:0], problems = problems, []  # identity problems once per mode
            rows.append(row)
        if mode in REFERENCE_MODES and e_mode and "no_prefix_caching" not in e_mode:
            problems.append("e2 did not run the cases with prefix caching off")
        if mode in GATE_MODES:
            shown, hit_issues = hit_problems(mode, s_mode, e_mode)
            rows.append(Row(mode, "(prefix hits)", 0, {}, {}, 0, shown, kv, None,
                            problems + hit_issues))
        elif problems:
            rows.append(Row(mode, "(engines)", 0, {}, {}, 0, {}, kv, None, problems))
    return rows


def _identity(mode: str, s_mode: dict, e_mode: dict) -> list[str]:
    """E2 must really be E2 (its boot report in the log), stock must not."""
    problems = []
    if s_mode.get("engine", {}).get("e2_banner"):
        problems.append("the stock engine logged E2's boot report: it is not stock vLLM")
    if e_mode.get("engine") is not None and not e_mode["engine"].get("e2_banner"):
        problems.append("the E2 engine did not log E2's boot report (vLLM E2 series ...): "
                        "the overlay is not in effect")
    return problems


def _compare_reference(row: Row, e_case: dict, reference: dict) -> None:
    """E2's tokens against E2's engine with prefix caching off, request by request:
    a prefix hit must resume from the state the recomputation reaches. That
    engine must really run without the cache: no hit, no E2 boot report lost."""
    if not reference.get("engine", {}).get("e2_banner"):
        row.problems.append("the E2 engine with prefix caching off did not log E2's boot "
                            "report: the overlay is not in effect")
    if reference.get("engine", {}).get("enable_prefix_caching"):
        row.problems.append("the reference engine resolved prefix caching on")
    r_case = reference.get("cases", {}).get(row.case)
    if r_case is None:
        row.problems.append("not run on E2 with prefix caching off")
        return
    if r_case.get("prefix_cache_hits", 0) > 0:
        row.problems.append(f"e2 with prefix caching off: {r_case['prefix_cache_hits']} "
                            "prefix-cache hit tokens")
    matched = 0
    for index, (e_req, r_req) in enumerate(zip(e_case["requests"], r_case["requests"])):
        ids = e_req.get("token_ids")
        if ids is not None and ids == r_req.get("token_ids") and complete(
                r_req, r_case["max_tokens"]):
            matched += 1
            continue
        first = _first_difference(r_req.get("token_ids") or [], ids or [])
        if not parted_at_a_near_tie(r_req, e_req, first):
            row.problems.append(f"request {index}: e2's token ids differ from position "
                                f"{first} from e2's with prefix caching off")
    row.reference = f"{matched}/{len(r_case['requests'])}"


def _compare_case(mode: str, name: str, s_case: dict, e_case: dict, kv: dict) -> Row:
    problems = []
    sides = {"stock": s_case, "e2": e_case}
    n = len(s_case["requests"])
    if len(e_case["requests"]) != n:
        problems.append(f"{n} requests on stock, {len(e_case['requests'])} on e2")
    done = {side: sum(complete(r, c["max_tokens"]) for r in c["requests"])
            for side, c in sides.items()}
    tokens = {side: sum(len(r.get("token_ids") or []) for r in c["requests"])
              for side, c in sides.items()}
    for side, case in sides.items():
        if done[side] != len(case["requests"]):
            errors = {r.get("error") for r in case["requests"] if r.get("error")}
            problems.append(f"{side}: {done[side]}/{len(case['requests'])} complete"
                            + (f" ({'; '.join(sorted(errors))[:300]})" if errors else ""))
    matched = close = 0
    for index, (s_req, e_req) in enumerate(zip(s_case["requests"], e_case["requests"])):
        if s_req.get("token_ids") is not None and s_req.get("token_ids") == e_req.get("token_ids"):
            matched += 1
            continue
        first = _first_difference(s_req.get("token_ids") or [], e_req.get("token_ids") or [])
        if parted_at_a_near_tie(s_req, e_req, first):
            close += 1
        else:
            problems.append(f"request {index}: token ids differ from position {first}"
                            + _tops_note(s_req, e_req, first))
    exercised = {}
    for side, case in sides.items():
        expect = case.get("expect")
        if expect == "prefix_hits":
            exercised[side] = f"{case['prefix_cache_hits']} prefix-cache hit tokens"
            if case["prefix_cache_hits"] <= 0:
                problems.append(f"{side}: no prefix-cache hit (vllm:prefix_cache_hits)")
        elif expect in ("preemptions", "more_running"):
            exercised[side] = f"{case['preemptions']} preemptions"
            if case.get("peak_running") is not None:
                peak = case["peak_running"]
                exercised[side] += (f", {case['mean_running']} running per step, "
                                    + (f"{peak} at most" if peak else "gauge read none"))
            problems += _concurrency_problems(expect, side, case, s_case)
    return Row(mode, name, n, done, tokens, matched, exercised, kv, None, problems, close)


def _concurrency_problems(expect: str, side: str, case: dict, s_case: dict) -> list[str]:
    """A concurrent case's path: stock preempts and resumes (``preemptions``);
    E2, which admits with the room its requests will take, never preempts more
    than stock; and where the case is built for it (``more_running``), E2 runs
    more requests per engine step than stock.

    Requests per step come from the engine's own counters, so they follow the
    schedule alone; the running gauge's peak is only as good as the readings that
    landed while the requests ran (a short case can finish between two), so it is
    reported and never judged."""
    problems = []
    # No step counted while the requests ran: unmeasured (None: a record made
    # before the probe counted steps, judged as it was then).
    if case.get("mean_running") == 0:
        problems.append(f"{side}: the engine counted no step with a running request "
                        "(vllm:generation_tokens_total over vllm:iteration_tokens_total)")
    if expect == "preemptions" and side == "stock" and case["preemptions"] <= 0:
        problems.append("stock: no preemption (vllm:num_preemptions)")
    if side != "e2":
        return problems
    if case["preemptions"] > s_case["preemptions"]:
        problems.append(f"e2 preempted {case['preemptions']} times, stock "
                        f"{s_case['preemptions']}")
    if expect == "more_running" and (case.get("mean_running") or 0) <= (
            s_case.get("mean_running") or 0):
        problems.append(f"e2 ran {case.get('mean_running')} requests per step, stock "
                        f"{s_case.get('mean_running')}: no more at once")
    return problems


def parted_at_a_near_tie(s_req: dict, e_req: dict, position: int) -> bool:
    """Two complete outputs of a concurrent case that part at ``position`` where
    each side's token is among the other's top tokens there (vLLM's
    check_logprobs_close): the sides batched the request differently and bf16
    sums followed the batch; after that position the outputs legitimately
    differ. A wrong state or KV block parts them at a token the other side
    does not rank at all. Records without top tokens compare exactly."""
    s_ids, e_ids = s_req.get("token_ids") or [], e_req.get("token_ids") or []
    s_tops, e_tops = s_req.get("top_logprobs"), e_req.get("top_logprobs")
    if (not s_tops or not e_tops or len(s_ids) != len(e_ids)
            or position >= min(len(s_tops), len(e_tops), len(s_ids))):
        return False
    s_ranked = {token for token, _ in s_tops[position]}
    e_ranked = {token for token, _ in e_tops[position]}
    return e_ids[position] in s_ranked and s_ids[position] in e_ranked


def _tops_note(s_req: dict, e_req: dict, position: int) -> str:
    s_tops, e_tops = s_req.get("top_logprobs"), e_req.get("top_logprobs")
    if not s_tops or not e_tops or position >= min(len(s_tops), len(e_tops)):
        return ""
    return (f" (stock's top there {s_tops[position]}, e2's {e_tops[position]}: not a "
            "near tie)")


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
