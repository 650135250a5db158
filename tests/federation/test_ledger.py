import pickle

import pytest
import torch

from fedlightning.federation.ledger import CommLedger, unpacked
from fedlightning.messages import ClientUpdate, ServerBroadcast


def _update(client, rnd):
    return ClientUpdate(
        rnd,
        {"model.w": torch.zeros(3, 4), "model.b": torch.zeros(4, dtype=torch.float64)},
        {"num_examples": 10.0, "train_loss": 0.5},
        client_id=client,
    )


def test_counts_match_hand_counts():
    led = CommLedger()
    for r in (1, 2):
        bc = ServerBroadcast(r, {"model.w": torch.zeros(3, 4), "model.b": torch.zeros(4)})
        for c in (0, 1, 2):
            led.record("down", c, bc)
            led.record("up", c, _update(c, r))
    # one update: 12 + 4 tensor values + 2 scalars = 18; 3 clients x 2 rounds
    assert led.total("up") == 18 * 6
    assert led.total("down") == 16 * 6
    assert led.total("up", round=1) == 54
    assert led.total("up", client=2) == 36
    # bytes: w float32 12*4, b float64 4*8, two scalars 2*4 = 88 per update
    assert led.total_bytes("up") == 88 * 6
    assert led.by("field")["num_examples"] == {"up": 6, "down": 0}
    assert led.by("field")["model.w"] == {"up": 72, "down": 72}
    assert led.mib("up") == pytest.approx(4 * 108 / 1024**2)
    s = led.summary()
    assert s["uplink_mib"] == pytest.approx(4 * 108 / 1024**2)
    assert s["per_client"]["0"] == {"up": 36, "down": 32}
    assert s["per_round"]["2"] == {"up": 54, "down": 48}


def test_state_roundtrip_and_direction_check():
    led = CommLedger()
    led.record("up", 0, _update(0, 1))
    led2 = CommLedger()
    led2.load_state_dict(led.state_dict())
    assert led2.summary() == led.summary()
    with pytest.raises(ValueError, match="direction"):
        led.record("sideways", 0, _update(0, 1))


def test_each_state_dict_packs_only_the_entries_since_the_last():
    """A checkpoint per round pickles that round's entries once (not the whole run's again);
    reloading, extending and comparing see the entries, however they were chunked."""
    led = CommLedger()
    led.record("up", 0, _update(0, 1))  # 4 entries: model.w, model.b, two scalars
    first = led.state_dict()
    assert [len(pickle.loads(c)) for c in first["packed"]] == [4]
    led.state_dict()  # nothing new: no new chunk
    for c in (0, 1):
        led.record("up", c, _update(c, 2))
    led.reject([])
    second = led.state_dict()
    assert [len(pickle.loads(c)) for c in second["packed"]] == [4, 8]
    assert second["packed"][0] is first["packed"][0]  # round 1 was not pickled again
    back = CommLedger()
    back.load_state_dict(second)
    assert back.entries == led.entries and back.total("up") == led.total("up") == 3 * 18
    assert unpacked(back.state_dict()) == unpacked(second)  # one chunk against two
    assert len(back.state_dict()["packed"]) == 1
    # a state saved before packing: a list of tuples, the oldest without scope
    old = {"entries": [e[:6] for e in led.entries]}
    assert unpacked(old)["entries"] == led.entries
    # another process's records appended after these ones, as recording them here would
    part = CommLedger()
    part.record("down", 2, _update(2, 3))
    both = CommLedger()
    both.load_state_dict(second)
    both.extend(part.state_dict())
    led.record("down", 2, _update(2, 3))
    assert both.entries == led.entries and both.summary() == led.summary()
