"""The committed stubs in stepahead/v1 are exactly what protoc makes of protos/."""

from __future__ import annotations

from pathlib import Path

from stepahead import protogen


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    committed_dir = protogen.ROOT / "stepahead" / "v1"
    committed = sorted(
        p.relative_to(protogen.ROOT) for p in committed_dir.glob("*_pb2*.py*")
    )
    assert committed == generated, "stub files differ from protos/: run python -m stepahead.protogen"
    for rel in generated:
        fresh = (tmp_path / rel).read_text()
        assert (protogen.ROOT / rel).read_text() == fresh, f"{rel} is stale: run python -m stepahead.protogen"


def test_every_field_is_documented() -> None:
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option"))
            if is_field:
                prev = lines[i - 1].strip()
                assert prev.startswith("//"), f"{proto.name}:{i + 1} field without a doc comment: {stripped}"
