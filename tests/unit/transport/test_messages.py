"""Protocol records: the same typed record in process and after the trip through gRPC's message."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import (
    Beat,
    IslandStatus,
    JoinInfo,
    LastClose,
    PushAck,
    RoundRequest,
    RoundStatus,
    SynchronizerStatus,
    VersionUpdate,
)
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.messages import from_message, join_info, join_reply, to_message, version_header, version_update


def _status(**changes) -> SynchronizerStatus:
    islands = {
        0: IslandStatus(live=True, world_size=2, steps=40, schedule_step=44, step_time_s=0.25, accepted=3, seen_s_ago=0.5,
                        merged_s_ago=1.5),
        7: IslandStatus(live=False, world_size=1, steps=0, schedule_step=0, step_time_s=0.0, accepted=0, seen_s_ago=30.0),
    }
    rounds = {
        0: RoundStatus(round=5, open=True, open_contributors=1, waiting_late=1, closed=4, merged_entries=7, merged_late=2,
                       superseded=1, clipped=1, dropped=0, grace_wait_total_s=0.5, grace_wait_max_s=0.25,
                       last=LastClose(round=4, version=4, contributors=2, late=1, clipped=0, dropped=0, grace_wait_s=0.125,
                                      reason="quorum 1 and the grace window")),
        1: RoundStatus(round=0, open=False, open_contributors=0, waiting_late=0, closed=0, merged_entries=0, merged_late=0,
                       superseded=0, clipped=0, dropped=0, grace_wait_total_s=0.0, grace_wait_max_s=0.0),
    }
    status = SynchronizerStatus(
        shard=1, num_shards=2, incarnation="abc", layout_hash="h1", outer_steps=4, run_step=44, sync_every=8,
        num_fragments=2, min_quorum=1, bytes_in=10**12, bytes_out=3, checkpoint_failures=1,
        last_checkpoint_error="OSError: disk full", last_checkpoint_outer_steps=3, versions={0: 4, 1: -1},
        live_islands=[0], islands=islands, rounds=rounds, accepted={"on_time": 5, "late": 2},
        refused={"bad_counters": 1}, adjustments=["num_fragments lowered from 24 to 2"],
    )
    return dataclasses.replace(status, **changes)


@pytest.mark.parametrize("status", [_status(), _status(islands={}, rounds={}, versions={}, live_islands=[], adjustments=[])],
                         ids=["every field", "nothing yet"])
def test_a_status_comes_back_from_its_message_unchanged(status):
    message = to_message(status, pb.StatusReply())
    back = from_message(pb.StatusReply.FromString(message.SerializeToString()), SynchronizerStatus)
    assert back == status
    # unset stays unset: "never merged" and "no round closed yet" are not 0
    if status.islands:
        assert back.islands[7].merged_s_ago is None and back.rounds[1].last is None


@pytest.mark.parametrize("record, message", [
    (IslandStatus, pb.IslandStatus), (LastClose, pb.LastClose), (RoundStatus, pb.RoundStatus),
    (SynchronizerStatus, pb.StatusReply), (PushAck, pb.PushAck), (RoundRequest, pb.RoundRequest), (Beat, pb.HeartbeatReply),
])
def test_the_dataclasses_and_the_messages_have_the_same_fields(record, message):
    assert {f.name for f in dataclasses.fields(record)} == set(message.DESCRIPTOR.fields_by_name)


def test_json_has_text_keys_and_plain_values():
    data = _status().to_dict()
    assert data["islands"][0]["merged_s_ago"] == 1.5 and data["rounds"][0]["last"]["contributors"] == 2


def test_records_converted_by_hand_come_back_unchanged():
    info = JoinInfo(config=RunConfig(), layout_hash="abc", versions={0: 3, 2: -1}, run_step=48, session="s1",
                    incarnation="i1")
    reply = pb.JoinReply.FromString(join_reply(info, shard=1, num_shards=2).SerializeToString())
    assert join_info(reply) == info and (reply.shard, reply.num_shards) == (1, 2)
    update = VersionUpdate(fragment=2, version=5, base_version=4, round=7, codec="bf16", payload=bytearray(b"xy"),
                           included=True)
    header = pb.FragmentHeader.FromString(version_header(update, payload_bytes=2).SerializeToString())
    assert version_update(header, bytearray(b"xy")) == update and header.payload_bytes == 2
