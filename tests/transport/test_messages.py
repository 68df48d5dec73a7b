"""Protocol records: the same typed record in process and after the trip through gRPC's message."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import (
    Beat,
    Contribution,
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
from lightning_diloco.transport.messages import from_header, from_message, join_info, join_reply, to_header, to_message


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


def test_the_join_reply_converted_by_hand_comes_back_unchanged():
    info = JoinInfo(config=RunConfig(), layout_hash="abc", versions={0: 3, 2: -1}, run_step=48, session="s1",
                    incarnation="i1")
    reply = pb.JoinReply.FromString(join_reply(info, shard=1, num_shards=2).SerializeToString())
    assert join_info(reply) == info and (reply.shard, reply.num_shards) == (1, 2)


PUSH = Contribution(island=3, fragment=2, round=7, base_version=4, tokens=250.5, steps=6, codec="int4", seq=9,
                    layout_hash="h1", payload=bytearray(b"xyz"), session="s1")
UPDATE = VersionUpdate(fragment=2, version=5, base_version=4, round=7, codec="bf16", payload=bytearray(b"xy"), included=True)


@pytest.mark.parametrize("record, header", [(PUSH, pb.PushHeader), (UPDATE, pb.FragmentHeader)], ids=["push", "version"])
def test_a_record_with_a_payload_comes_back_from_its_header_and_chunks_unchanged(record, header):
    message = header.FromString(to_header(record, header(), payload_bytes=3).SerializeToString())
    assert message.payload_bytes == 3
    assert from_header(message, type(record), record.payload) == record


@pytest.mark.parametrize("record, header, seed_only", [
    (Contribution, pb.PushHeader, set()), (VersionUpdate, pb.FragmentHeader, {"island", "session"}),
])
def test_a_header_has_its_records_fields_but_the_payload_and_declares_the_payloads_size(record, header, seed_only):
    fields = {f.name for f in dataclasses.fields(record)} - {"payload"}
    assert fields | {"payload_bytes"} | seed_only == set(header.DESCRIPTOR.fields_by_name)


def test_an_in_process_push_without_a_session_leaves_the_headers_unset():
    message = to_header(dataclasses.replace(PUSH, session=None), pb.PushHeader(), payload_bytes=3)
    assert message.session == "" and message.seq == 9
