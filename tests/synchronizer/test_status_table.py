"""`lightning-diloco status`'s table: what an operator reads about each island."""

from lightning_diloco.synchronizer.main import format_status
from tests.transport.test_messages import _status


def test_the_table_shows_each_islands_processes():
    """An island of several processes (DDP, FSDP2, several nodes) joins once, from its rank 0,
    with its world size: the table says how many processes each island is."""
    lines = format_status(_status()).splitlines()
    header = next(line for line in lines if line.split()[:1] == ["island"]).split()
    assert header[:3] == ["island", "live", "procs"]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in ("0", "7") and len(line.split()) == 7}
    assert rows["0"][:4] == ["0", "yes", "2", "40"] and rows["7"][:4] == ["7", "no", "1", "0"]
