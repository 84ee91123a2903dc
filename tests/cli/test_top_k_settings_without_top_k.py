"""Issue 64's smaller items: a top-k key top-k could never run is refused whatever the compression (it was
ignored without a word), ..."""

from __future__ import annotations

import pytest

from edit_train.cli.common import compose
from edit_train.config import ConfigError, validate


@pytest.mark.parametrize("compression", ["none", "int8"])
@pytest.mark.parametrize("override, key", [("sync.bits=3", "sync.bits"), ("sync.topk_density=2", "sync.topk_density"),
                                           ("sync.topk_group=3", "sync.topk_group")])
def test_an_impossible_top_k_setting_is_refused_without_top_k(compression: str, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose(["logger=none", f"sync.compression={compression}", override]))
    line = str(err.value)
    assert line.startswith(f"{key}: ") and f"sync.compression={compression} does not use it" in line, line
    assert "\n" not in line
    with pytest.raises(ConfigError, match=f"^{key}"):  # and with top-k, as before
        validate(compose(["logger=none", "sync.compression=topk", override]))


def test_a_valid_top_k_setting_without_top_k_is_still_accepted() -> None:
    validate(compose(["logger=none", "sync.compression=int8", "sync.bits=4", "sync.topk_density=0.05"]))  # a sweep's


def test_warming_the_top_k_kernels_says_what_start_up_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    """A top-k run's start-up loads (first time on a machine: compiles, tens of seconds) numba's kernels: one line
    says so before the wait."""
    import logging

    from edit_train.codec import compiled, sparse, sparse_fused
    from edit_train.codec.dense import CompressionConfig
    from edit_train.config import SyncConfig

    if not sparse_fused.AVAILABLE:
        pytest.skip("numba is not installed")
    f = CompressionConfig.of(SyncConfig(compression="topk")).format  # the default format: the suite compiles it
    with caplog.at_level(logging.INFO, logger="edit_train.codec.sparse"):
        sparse.warm(f)
    said = [r.getMessage() for r in caplog.records if r.name == "edit_train.codec.sparse"]
    assert said and said[0].startswith("top-k kernels (numba): ") and compiled.key(f) in said[0], said
    assert ("loading" in said[0]) == (len(said) == 1), said  # a compile also says where the kernels are kept
    with caplog.at_level(logging.INFO, logger="edit_train.codec.sparse"):
        caplog.clear()
        sparse.warm(f)  # now on disk here: loading, one line
    assert [r.getMessage() for r in caplog.records][0].startswith("top-k kernels (numba): loading"), caplog.records
