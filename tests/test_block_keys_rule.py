"""One rule for "does this policy need prompt block keys" (policies.base.needs_block_keys) and one
refusal of a policy that would route blind (router.config.refuse_blind_policies), which the
router's builder applies too, for a config built in code without load_config."""

from __future__ import annotations

import pytest

from policies.base import BasePolicy, build_policy, needs_block_keys
from router.config import ConfigError, EngineConfig, PolicyConfig, RouterConfig
from router.service import build_router_app


class _IndexReader(BasePolicy):
    """Reads the index but says it needs no keys: the index is keyed by them, so it does."""

    uses_index = True
    needs_block_keys = False


def test_reading_the_index_needs_keys_whatever_the_attribute_says() -> None:
    # router/config.py's old copy let needs_block_keys = False override uses_index.
    assert needs_block_keys(_IndexReader) and needs_block_keys(_IndexReader())
    assert needs_block_keys(build_policy("approx_prefix"))  # learns from keys, reads no index
    assert needs_block_keys(build_policy("tier_cost"))
    assert not needs_block_keys(build_policy("round_robin"))


def test_the_builder_refuses_a_blind_policy_in_a_config_built_in_code() -> None:
    config = RouterConfig(
        engines=[EngineConfig(id="a", url="http://127.0.0.1:9")], policy=PolicyConfig(name="kv_gpu")
    )
    with pytest.raises(ConfigError, match=r'policy "kv_gpu" matches prompt blocks'):
        build_router_app(config)
