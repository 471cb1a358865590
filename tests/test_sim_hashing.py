"""The simulated engine's block hashes: vLLM's exact sha256_cbor values and the own default."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from kvcore.keys import block_keys
from sim.engine import EngineCore, EngineProfile, SimRequest
from sim.hashing import (
    VLLM_NONE_HASH,
    HashChain,
    event_block_hash,
    pack_token_ids,
    sha256_block_hash,
    sha256_cbor_block_digest,
)

# Test vectors from docs/vllm-contract.md section 3 (tokens 0..15 then 16..31, no extra keys).
NONE_HASH_HEX = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
BLOCK0_HEX = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
BLOCK1_HEX = "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c"
BLOCK0_EVENT = 2233398808101521225
BLOCK1_EVENT = 17911472383915781900


def test_vllm_none_hash_matches_contract() -> None:
    assert VLLM_NONE_HASH.hex() == NONE_HASH_HEX


def test_sha256_cbor_digests_match_vllm_vectors() -> None:
    d0 = sha256_cbor_block_digest(None, list(range(16)))
    d1 = sha256_cbor_block_digest(d0, list(range(16, 32)))
    assert d0.hex() == BLOCK0_HEX
    assert d1.hex() == BLOCK1_HEX
    assert event_block_hash(d0) == BLOCK0_EVENT
    assert event_block_hash(d1) == BLOCK1_EVENT


def test_hash_chain_sha256_cbor_gives_event_ints() -> None:
    chain = HashChain("sha256_cbor")
    chain.append(list(range(16)))
    chain.append(list(range(16, 32)))
    assert chain.hashes == [BLOCK0_EVENT, BLOCK1_EVENT]


def test_engine_in_sha256_cbor_mode_publishes_vllm_values() -> None:
    engine = EngineCore("e0", EngineProfile(num_gpu_blocks=16, hash_algo="sha256_cbor"))
    engine.add_request(SimRequest("r", list(range(33)), max_tokens=1))
    out = engine.step()
    stored = [e for e in out.events if e["type"] == "BlockStored"]
    assert len(stored) == 1
    assert stored[0]["block_hashes"] == [BLOCK0_EVENT, BLOCK1_EVENT]
    assert stored[0]["parent_block_hash"] is None


def test_cbor_extra_keys_are_folded_as_in_vllm() -> None:
    # The salted digest is sha256 of the canonical CBOR array [NONE_HASH, tokens, ["tenant-b"]].
    expected = hashlib.sha256(
        cbor2.dumps([VLLM_NONE_HASH, list(range(16)), ["tenant-b"]], canonical=True)
    ).digest()
    assert sha256_cbor_block_digest(None, list(range(16)), ("tenant-b",)) == expected
    assert expected.hex() != BLOCK0_HEX


def test_own_sha256_is_deterministic_and_chained() -> None:
    a, b = HashChain("sha256"), HashChain("sha256")
    for chain in (a, b):
        chain.append(list(range(16)))
        chain.append(list(range(16, 32)))
    assert a.hashes == b.hashes
    assert a.hashes[0] == sha256_block_hash(None, pack_token_ids(range(16)))
    assert a.hashes[1] == sha256_block_hash(a.hashes[0], pack_token_ids(range(16, 32)))
    # Same tokens under another parent give another hash: only prefixes match.
    assert sha256_block_hash(None, pack_token_ids(range(16, 32))) != a.hashes[1]
    assert all(0 <= h < 2**64 for h in a.hashes)


def test_own_hashes_differ_from_router_keys_and_from_vllm() -> None:
    tokens = list(range(32))
    own = HashChain("sha256")
    for i in range(2):
        own.append(tokens[i * 16 : (i + 1) * 16])
    router = block_keys(tokens, 16)
    assert set(own.hashes).isdisjoint(router)
    assert set(own.hashes).isdisjoint({BLOCK0_EVENT, BLOCK1_EVENT})


def test_extra_keys_change_the_hash() -> None:
    plain = sha256_block_hash(None, pack_token_ids(range(16)))
    salted = sha256_block_hash(None, pack_token_ids(range(16)), ("tenant-b",))
    other = sha256_block_hash(None, pack_token_ids(range(16)), ("tenant-c",))
    assert len({plain, salted, other}) == 3


def test_trace_ids_beyond_int64_are_accepted() -> None:
    chain = HashChain("sha256")
    chain.append([2**64 - 1])
    chain.append([5])
    assert len(chain.hashes) == 2


def test_unknown_algorithm_is_rejected_with_the_accepted_names() -> None:
    with pytest.raises(ValueError, match="sha256_cbor"):
        HashChain("xxhash")
    with pytest.raises(ValueError, match="hash_algo"):
        EngineProfile(hash_algo="md5")


def test_hash_cache_gives_the_same_values_and_is_bounded() -> None:
    from sim.hashing import BlockHashCache

    for algo in ("sha256", "sha256_cbor"):
        cache = BlockHashCache(max_entries=3)
        cold = HashChain(algo)
        warm_a, warm_b = HashChain(algo, cache), HashChain(algo, cache)
        for chain in (cold, warm_a, warm_b):
            for i in range(4):
                chain.append(list(range(i * 16, (i + 1) * 16)), ("s",) if i == 0 else None)
        assert cold.hashes == warm_a.hashes == warm_b.hashes
        assert len(cache) <= 3
    assert HashChain("sha256_cbor", BlockHashCache()).append(list(range(16))) == BLOCK0_EVENT
