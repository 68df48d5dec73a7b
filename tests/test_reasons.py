import grpc

from lightning_diloco.reasons import REJOIN, Reason
from lightning_diloco.synchronizer.server import STATUS


def test_a_status_details_reason_is_parsed_back_and_anything_else_is_unknown():
    assert Reason.parse("wrong_session: island 0 joined again") is Reason.WRONG_SESSION in REJOIN
    assert Reason.parse("Socket closed") is Reason.UNKNOWN and Reason.parse("") is Reason.UNKNOWN
    assert f"{Reason.BAD_PAYLOAD}: x" == "bad_payload: x" and Reason.BAD_PAYLOAD == "bad_payload"


def test_only_the_server_maps_reasons_to_grpc_codes():
    assert STATUS[Reason.UNAUTHENTICATED] is grpc.StatusCode.UNAUTHENTICATED
    assert all(isinstance(r, Reason) for r in STATUS)
