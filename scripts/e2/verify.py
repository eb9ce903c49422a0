"""The checks of e2 verify (commands/verify.py): is the series whole, exact, and
are the generated files in sync?"""

from __future__ import annotations

from dataclasses import dataclass, field

import git

from e2.apply import AppliedTree, ScratchTree, UpstreamOptions
from e2.dockerfile import dockerfile_drift, has_dockerfile
from e2.errors import E2Error
from e2.overlay import PACKAGE, OverlayPlan, overlay_drift, plan_overlay, sync_problems
from e2.series import Project, Series
from e2.upstream_checks import run as run_upstream_checks

REGISTRY_FILE = f"{PACKAGE}/e2_switches.py"


@dataclass
class Check:
    name: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_ids(series: Series) -> Check:
    check = Check("patch ids unique and contiguous")
    ids = [p.id for p in series.patches]
    for duplicate in sorted({i for i in ids if ids.count(i) > 1}):
        check.problems.append(f"id {duplicate} is used twice in series.yaml; give each "
                              "patch its own id")
    expected = [f"{n:04d}" for n in range(1, len(ids) + 1)]
    if not check.problems and ids != expected:
        check.problems.append(f"ids are {', '.join(ids)}; expected {', '.join(expected)} "
                              "(renumber in series.yaml, or re-export with e2 export)")
    for patch in series.patches:
        if not patch.file.startswith(patch.id + "-"):
            check.problems.append(f"{patch.id}: file {patch.file} should start with "
                                  f"'{patch.id}-'")
    switches = [p.switch.name for p in series.patches]
    for name in sorted({s for s in switches if switches.count(s) > 1}):
        check.problems.append(f"switch {name} is declared by more than one patch")
    return check


def check_patch_files(project: Project, series: Series) -> Check:
    check = Check("series.yaml and patches/ agree")
    listed = {p.file for p in series.patches}
    for patch in series.patches:
        if not project.patch_path(patch).is_file():
            check.problems.append(f"{patch.id}: patches/{patch.file} is missing; restore it "
                                  "or remove the entry from series.yaml")
    on_disk = {p.name for p in project.patches_dir.glob("*.patch")}
    for name in sorted(on_disk - listed):
        check.problems.append(f"patches/{name} is not listed in series.yaml; add an entry "
                              "or delete the file")
    return check


def scan_switch_reads(repo: git.Repo) -> dict[str, set[str]]:
    """Each VLLM_E2_* name in the patched vllm/ tree (HEAD), with the files naming it."""
    try:
        hits = repo.git.grep("-o", "-I", "-E", r"\bVLLM_E2_[A-Z0-9_]+\b", "HEAD", "--",
                             f"{PACKAGE}/")
    except git.GitCommandError as exc:
        if exc.status == 1:  # git grep: no match
            return {}
        raise
    found: dict[str, set[str]] = {}
    for line in hits.splitlines():
        _, path, name = line.split(":", 2)
        found.setdefault(name, set()).add(path)
    return found


def check_switch_reads(series: Series, tree: AppliedTree) -> Check:
    check = Check("every switch is read, every read switch is declared")
    reads = scan_switch_reads(tree.repo)
    declared = {p.switch.name: p.id for p in series.patches}
    for name, patch_id in declared.items():
        sites = reads.get(name, set()) - {REGISTRY_FILE}
        if not sites:
            check.problems.append(f"{patch_id}: switch {name} is never read in the patched "
                                  f"{PACKAGE}/ tree (outside the registry in {REGISTRY_FILE}); "
                                  "read it where the feature branches, or fix the name")
    for name in sorted(reads.keys() - declared.keys()):
        files = ", ".join(sorted(reads[name]))
        check.problems.append(f"{name} is read in {files} but no patch declares it; add it "
                              "to that patch's switch in series.yaml")
    return check


def check_tests_exist(series: Series, tree: AppliedTree) -> Check:
    check = Check("declared tests exist in the patched tree")
    head = tree.repo.head.commit.tree
    for patch in series.patches:
        for node in patch.tests:
            path = node.split("::", 1)[0].rstrip("/")
            try:
                head[path]
            except KeyError:
                check.problems.append(f"{patch.id}: test {node} does not exist in the patched "
                                      "tree; fix the path in series.yaml")
    return check


def check_overlay(project: Project, series: Series, plan: OverlayPlan) -> Check:
    check = Check("overlay/ equals what the series generates")
    check.problems += sync_problems(project, series)  # the check status and the image use
    if check.problems:
        return check
    drift = overlay_drift(project, plan)
    check.problems += [f"{line} (run e2 overlay)" for line in drift[:20]]
    if len(drift) > 20:
        check.problems.append(f"... and {len(drift) - 20} more (run e2 overlay)")
    return check


def check_dockerfile(project: Project, series: Series, plan: OverlayPlan) -> Check:
    check = Check("Dockerfile equals what images/engine/Dockerfile.j2 renders")
    try:
        check.problems += dockerfile_drift(project, series, plan.manifest)
    except E2Error as exc:  # a template that does not render
        check.problems.append(str(exc))
    return check


def check_upstream_findings(series: Series, tree: AppliedTree, upstream: UpstreamOptions,
                            ) -> Check:
    check = Check(f"{series.upstream.tag}'s own checks find nothing new in the files the "
                  "series changes")
    try:
        found = run_upstream_checks(tree.repo, tree.base_commit, tree.head,
                                    upstream.cache.cache, tree.path.parent,
                                    series.upstream.tag)
    except E2Error as exc:
        check.problems.append(str(exc))
        return check
    check.problems += [str(f) for f in found]
    return check


def verify(project: Project, series: Series, upstream: UpstreamOptions) -> list[Check]:
    # series.yaml's schema is checked by loading it: a series that got here passed.
    checks = [check_ids(series), check_patch_files(project, series)]
    if not all(c.ok for c in checks):
        return checks  # applying a series whose files disagree would only add noise
    applies = Check("every patch applies exactly")
    checks.append(applies)
    try:
        with ScratchTree(project, series, upstream) as tree:
            checks.append(check_switch_reads(series, tree))
            checks.append(check_tests_exist(series, tree))
            checks.append(check_upstream_findings(series, tree, upstream))
            plan = plan_overlay(series, project, tree)
            checks.append(check_overlay(project, series, plan))
            if has_dockerfile(project):  # projects without the image template skip it
                checks.append(check_dockerfile(project, series, plan))
    except E2Error as exc:
        applies.problems.append(str(exc))
    return checks
