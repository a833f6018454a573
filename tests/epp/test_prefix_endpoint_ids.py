"""The endpoint ids and bitsets both prefix indexes share (epp/prefix/endpoint_ids.py)."""

from kvgate.epp.prefix.endpoint_ids import EndpointIds, bits, clear_holder, mask_to_bools


def test_ids_are_dense_reused_last_freed_first_and_the_epoch_follows_the_mapping():
    ids = EndpointIds()
    assert [ids.assign(a) for a in "abc"] == [0, 1, 2] and ids.count == 3
    epoch = ids.epoch
    assert ids.assign("b") == 1 and ids.epoch == epoch  # known: same id, mapping unchanged
    assert ids.release("a") == 0 and ids.release("c") == 2 and ids.release("zz") is None
    assert ids.addresses == [None, "b", None] and ids.get("a") is None
    assert ids.epoch == epoch + 2
    assert ids.assign("d") == 2 and ids.assign("e") == 0 and ids.assign("f") == 3
    assert ids.addresses == ["e", "b", "d", "f"] and ids.by_address == {"b": 1, "d": 2, "e": 0, "f": 3}


def test_bits_and_mask_to_bools_agree():
    mask = (1 << 0) | (1 << 7) | (1 << 8) | (1 << 999)
    assert list(bits(mask)) == [0, 7, 8, 999] and list(bits(0)) == []
    bools = mask_to_bools(mask, 1001)
    assert bools.dtype == bool and bools.shape == (1001,)
    assert bools.nonzero()[0].tolist() == [0, 7, 8, 999]
    assert not mask_to_bools(0, 5).any()


def test_clear_holder_drops_blocks_nobody_holds():
    holders = {10: 0b101, 11: 0b100}
    clear_holder(holders, 10, 0b100)
    clear_holder(holders, 11, 0b100)
    clear_holder(holders, 12, 0b1)  # unknown block: nothing to do
    assert holders == {10: 0b001}
