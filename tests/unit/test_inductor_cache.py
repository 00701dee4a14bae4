"""Inductor's caches key on cpcompile's sources: a changed region must never load a graph compiled for the old one."""

from __future__ import annotations

import shutil

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from cpcompile.inductor_cache import PACKAGE, CodeKey, cache_key_patches, source_fingerprint


def test_fingerprint_changes_with_any_source_file(tmp_path):
    copy = tmp_path / "cpcompile"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_fingerprint(copy)
    assert before == source_fingerprint(PACKAGE)  # the same sources, the same key
    ring = copy / "comms" / "ring" / "dense.py"
    ring.write_text(ring.read_text() + "\n# one more line\n")
    assert source_fingerprint.__wrapped__(copy) != before


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass"


def test_the_key_holds_the_fingerprint_and_keeps_a_user_pass():
    (key,) = cache_key_patches().values()
    assert isinstance(key, CodeKey) and source_fingerprint() in key.uuid()
    user = _UserPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        (key,) = cache_key_patches().values()
    key(torch.fx.Graph())
    assert user.calls == 1 and key.uuid() == ("cpcompile", source_fingerprint(), "user-pass")
