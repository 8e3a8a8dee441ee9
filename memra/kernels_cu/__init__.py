"""memra's CUDA kernel sources: one .cu file per op family and the .cuh headers they share."""

import hashlib


def with_header_digest(src: str, include_dir) -> str:
    """`src` with a closing comment that names a digest of every header in `include_dir`.

    CuPy's kernel cache keys a compile by its source text and options, not by the headers the
    source includes: without this, a family whose .cu text is unchanged would load the cubin built
    against its old headers after an upgrade or an edit. A comment after the last line changes no
    line number and no machine code."""
    digest = hashlib.sha256()
    for header in sorted((p for p in include_dir.iterdir() if p.name.endswith(".cuh")), key=lambda p: p.name):
        digest.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    return f"{src}\n// kernels_cu headers: sha256 {digest.hexdigest()}\n"
