"""The test cluster itself: committed rows survive a kill -9 of PostgreSQL and a restart."""

from __future__ import annotations

import psycopg
from postgres import Cluster


def test_a_committed_row_survives_a_kill_and_restart_of_the_cluster():
    with Cluster() as cluster:
        url = cluster.create_database()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (v int)")
            conn.execute("INSERT INTO t VALUES (7)")
        cluster.kill()
        cluster.start()
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT v FROM t").fetchall() == [(7,)]
