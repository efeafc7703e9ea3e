"""The island table of a client session (client/islands.py): restarts renew an island's entry and close its
links, health marks islands dead or serving again, a resume says whether an island is the one saved, and a link
made while the island restarted is refused. Links here are stand-ins that only open and close."""

from __future__ import annotations

import pytest

from client.islands import IslandClient, Islands
from pathways.errors import IslandFailedError
from pathways.topology import Topology


class FakeLink:
    def __init__(self) -> None:
        self.alive = True

    def close(self) -> None:
        self.alive = False


def _info(index: int, epoch: int = 0, healthy: bool = True, reason: str = "", hosts: int = 1) -> dict:
    return {"index": index, "epoch": epoch, "healthy": healthy, "reason": reason,
            "hosts": [{"client": f"pathways://h{index}-{h}:1", "memory_bytes": 100 + h, "device_bytes": 10 + h}
                      for h in range(hosts)]}


def test_the_table_starts_from_what_the_resource_manager_said():
    table = Islands([_info(0), _info(1, healthy=False, reason="host 0 died"), _info(2, epoch=3, healthy=False)])
    assert len(table) == 3 and [i.index for i in table] == [0, 1, 2] and table[2].epoch == 3
    assert isinstance(table[0], IslandClient) and table[0].hosts[0]["client"] == "pathways://h0-0:1"
    assert table.dead == {1: "host 0 died", 2: "unhealthy"} and table.sent_exes == [set(), set(), set()]


def test_a_restart_closes_the_links_and_forgets_the_executables():
    table = Islands([_info(0), _info(1)])
    link = table.adopt(0, 0, 0, FakeLink())
    table.sent_exes[0].add("exe")
    assert table.live_link(0, 0) is link
    assert not table.restarted(_info(0, epoch=0, healthy=False))  # same instance: only its health changes
    assert table[0].healthy is False and link.alive
    assert table.restarted(_info(0, epoch=1, hosts=2))
    assert not link.alive and table.live_link(0, 0) is None and table[0].links == {}
    assert table[0].epoch == 1 and len(table[0].hosts) == 2 and table.sent_exes[0] == set()


def test_health_marks_islands_dead_and_serving_again():
    table = Islands([_info(0), _info(1)])
    table.judge(_info(1, healthy=False, reason="gone"), restarted=False)
    table.judge(_info(1, healthy=False, reason="later words"), restarted=False)
    assert table.dead == {1: "gone"}  # the first reason stays
    table.judge(_info(1), restarted=False)
    assert table.dead == {}  # healthy, and no broken link
    table.dead[0] = "its link broke"
    broken = table.adopt(0, 0, 0, FakeLink())
    broken.alive = False
    table.judge(_info(0), restarted=False)
    assert table.dead == {0: "its link broke"}  # a broken link outweighs the manager's word until a restart
    table.restarted(_info(0, epoch=1))
    table.judge(_info(0, epoch=1), restarted=True)
    assert table.dead == {}


def test_a_resume_says_whether_the_island_is_the_one_saved():
    table = Islands([_info(0), _info(1), _info(2)])
    links = [table.adopt(k, 0, 0, FakeLink()) for k in range(3)]
    table.dead[0] = "stopped for the suspend"
    assert table.resumed(_info(0, hosts=1))  # same epoch, healthy: its messages resume where they stood
    assert table.dead == {} and not links[0].alive and table[0].links == {}
    assert not table.resumed(_info(1, epoch=1))  # another instance: this client's buffers are gone
    assert not table.resumed(_info(2, healthy=False, reason="lost"))
    assert table.dead == {2: "lost"} and not any(link.alive for link in links)


def test_a_link_made_while_the_island_restarted_is_refused_and_a_second_one_yields():
    table = Islands([_info(0, hosts=2)])
    info, epoch = table.target(0, 1)
    assert info["client"] == "pathways://h0-1:1" and epoch == 0
    first = table.adopt(0, 1, epoch, FakeLink())
    second = FakeLink()
    assert table.adopt(0, 1, epoch, second) is first and not second.alive  # another thread connected first
    table.restarted(_info(0, epoch=1, hosts=2))
    late = FakeLink()
    with pytest.raises(IslandFailedError, match="island 0 restarted while this client connected"):
        table.adopt(0, 1, epoch, late)
    assert not late.alive


def test_limits_are_the_smallest_host_and_close_closes_every_link():
    table = Islands([_info(0, hosts=2), _info(1)])
    limits = table.limits(0, Topology(islands=2, hosts_per_island=2, devices_per_host=4))
    assert (limits.island, limits.islands, limits.hosts, limits.devices_per_host) == (0, 2, 2, 4)
    assert (limits.memory_bytes, limits.device_bytes) == (100, 10)
    links = [table.adopt(0, 0, 0, FakeLink()), table.adopt(0, 1, 0, FakeLink()), table.adopt(1, 0, 0, FakeLink())]
    table.close()
    assert not any(link.alive for link in links)
