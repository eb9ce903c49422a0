"""series.yaml schema: every bad input names the file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2.errors import E2Error
from e2.series import dump_series, load_series, parse_series, series_digest, slugify

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD = (REPO_ROOT / "series.yaml").read_text()


def parse(text: str):
    return parse_series(text, Path("series.yaml"))


def errors_of(text: str) -> str:
    with pytest.raises(E2Error) as info:
        parse(text)
    return info.value.message


def test_project_series_loads_and_pins_0_31_0():
    series = load_series(REPO_ROOT / "series.yaml")
    assert series.upstream.version == "0.31.0"
    assert series.upstream.tag == "v0.31.0"
    assert series.upstream.sdist_sha256 == (
        "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380")
    assert series.image.base == "vllm/vllm-openai:v0.31.0"
    assert series.image.site_packages == "/usr/local/lib/python3.12/dist-packages"


def test_dump_is_canonical_and_round_trips():
    series = parse(GOOD)
    assert dump_series(series) == GOOD
    assert parse(dump_series(series)) == series


def test_malformed_yaml_names_line_and_column():
    text = GOOD.replace("  tag: v0.31.0", "  tag: [v0.31.0")
    message = errors_of(text)
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "[v0.31.0" in row)
    assert message.startswith("series.yaml:")
    assert "invalid YAML" in message
    reported = int(message.split(":")[1])
    assert line <= reported <= line + 2


def test_unknown_key_is_rejected_with_path_and_line():
    text = GOOD.replace("  tag: v0.31.0\n", "  tag: v0.31.0\n  branch: main\n")
    line = text.splitlines().index("  branch: main") + 1
    assert errors_of(text) == f"series.yaml:{line}:3: upstream.branch: unknown key"


def test_duplicate_key_is_rejected():
    text = GOOD.replace("  tag: v0.31.0\n", "  tag: v0.31.0\n  tag: v0.32.0\n")
    line = text.splitlines().index("  tag: v0.32.0") + 1
    assert errors_of(text) == f"series.yaml:{line}: duplicate key 'tag'"


def test_bad_sha256_and_digest_are_named():
    text = GOOD.replace("dde46f1e", "DDE46F1E").replace("digest: null", "digest: abc")
    message = errors_of(text)
    assert "upstream.sdist_sha256: Value error, must be 64 lowercase hex digits" in message
    assert "image.digest: Value error, must be sha256:<64 hex> or null" in message


PATCH = """\
patches:
- id: {id}
  file: 0001-x.patch
  title: x
  switch:
    name: {name}
    default: {default}
    compiled: false
    doc: d
  upstream: []
  drop_when: never
  tests:
  - tests/test_envs.py
"""


def with_patch(**fields) -> str:
    values = {"id": "'0001'", "name": "VLLM_E2_X", "default": "'1'", **fields}
    return GOOD[:GOOD.index("patches:")] + PATCH.format(**values)


def test_a_valid_patch_entry_parses():
    patch = parse(with_patch()).patches[0]
    assert (patch.id, patch.switch.name, patch.switch.default) == ("0001", "VLLM_E2_X", "1")


@pytest.mark.parametrize("field, value, expected", [
    ("id", "0001", "patches[0].id: Input should be a valid string"),
    ("id", "'1'", "patches[0].id: Value error, must be four digits"),
    ("name", "E2_X", "patches[0].switch.name: Value error, 'E2_X' must look like VLLM_E2_NAME"),
    ("default", "'on'", "patches[0].switch.default: Input should be '0' or '1'"),
    ("default", "1", "patches[0].switch.default: Input should be '0' or '1'"),
])
def test_bad_patch_fields_are_named(field, value, expected):
    text = with_patch(**{field: value})
    key = {"id": "- id:", "name": "    name:", "default": "    default:"}[field]
    line = next(n for n, row in enumerate(text.splitlines(), 1) if row.startswith(key))
    message = errors_of(text)
    assert expected in message
    assert message.startswith(f"series.yaml:{line}:")


def test_missing_required_field_is_named():
    text = with_patch().replace("  drop_when: never\n", "")
    assert "patches[0].drop_when: Field required" in errors_of(text)


# the billion laughs: nine levels of nine, 10^9 strings once expanded
BILLION_LAUGHS = 'lol0: &l0 "lol"\n' + "".join(
    f"lol{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]\n" for n in range(1, 10))


def test_yaml_anchors_and_aliases_are_refused_before_expanding():
    header, body = GOOD.split("upstream:", 1)
    text = header + BILLION_LAUGHS + "upstream:" + body
    line = header.count("\n") + 1
    assert errors_of(text) == (f"series.yaml:{line}:7: YAML anchor &l0: series.yaml may not "
                               "use anchors or aliases (write each value out)")


def test_a_yaml_alias_is_refused_where_it_stands():
    text = GOOD.replace("  version: 0.31.0", "  version: &v 0.31.0").replace(
        "  tag: v0.31.0", "  tag: v0.31.0\n  extra: *v")
    assert errors_of(text).startswith("series.yaml:6:12: YAML anchor &v")
    text = GOOD.replace("patches:", "patches: *nowhere\nxpatches:")
    line = text.splitlines().index("patches: *nowhere") + 1
    assert errors_of(text).startswith(f"series.yaml:{line}:10: YAML alias *nowhere")


def test_dump_writes_a_shared_value_out_twice_and_loads_back():
    data = parse(with_patch()).model_dump(mode="json")
    data["patches"].append({**data["patches"][0], "id": "0002", "file": "0002-y.patch"})
    text = dump_series(data)  # the two entries share their switch and tests objects
    assert "&" not in text and "*" not in text
    switches = [p.switch.model_dump() for p in parse(text).patches]
    assert switches == [data["patches"][0]["switch"]] * 2


def test_one_file_under_two_ids_is_refused():
    first = PATCH.format(id="'0001'", name="VLLM_E2_X", default="'1'")
    second = PATCH.format(id="'0002'", name="VLLM_E2_Y", default="'1'").replace(
        "patches:\n", "")
    text = GOOD[:GOOD.index("patches:")] + first + second
    line = [n for n, row in enumerate(text.splitlines(), 1) if row == "  file: 0001-x.patch"][1]
    assert errors_of(text) == (f"series.yaml:{line}:3: patches[1].file: 0001-x.patch is "
                               "listed under two ids, 0001 and 0002 (each patch has a file "
                               "of its own)")
    text = GOOD[:GOOD.index("patches:")] + first + first.replace("patches:\n", "")
    assert errors_of(text) == (f"series.yaml:{line}:3: patches[1].file: 0001-x.patch is "
                               "listed twice, both times as 0001 (each patch has a file of "
                               "its own)")


def test_series_digest_changes_with_patch_bytes(tmp_path):
    series = parse(with_patch())
    (tmp_path / "0001-x.patch").write_text("one\n")
    first = series_digest(series, tmp_path)
    assert first == series_digest(series, tmp_path)
    (tmp_path / "0001-x.patch").write_text("two\n")
    assert series_digest(series, tmp_path) != first


def test_series_digest_names_a_missing_patch(tmp_path):
    with pytest.raises(E2Error, match=r"0001-x.patch: listed in series.yaml as 0001 but missing"):
        series_digest(parse(with_patch()), tmp_path)


def test_slug_matches_format_patch_style():
    assert slugify("envs: strict VLLM_E2_* switch registry") == "envs-strict-vllm-e2-switch-registry"
