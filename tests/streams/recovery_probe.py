"""A stage-shaped faust app for tests/streams/test_recovery.py, built by the stages' own
``make_app``: it records every event of ``<prefix>in`` and ``<prefix>in2`` in a table and
echoes ``"<topic> <offset> <values in the table before it>"`` to ``<prefix>out``, so the first
event after a restart shows whether the table was restored. Before each seek faust makes, it
prints whether the fetcher and the agents' queues were running (the seek must find them
stopped, or events fetched during it are lost).

With ``slow-seek``, every seek waits a second first: long enough for a fetch that was in flight
when the stream partitions were resumed to come back with their events while the flow is still
stopped, which faust answers by seeking back to the committed offsets.

Usage: ``python -m tests.streams.recovery_probe BOOTSTRAP PREFIX [slow-seek]``
"""

from __future__ import annotations

import asyncio
import sys

from rollstream.app.stages import run_faust_app
from rollstream.config.base import KafkaConfig
from rollstream.streams.common import make_app, raw_topic

SLOW_SEEK_S = 1.0


def main(bootstrap: str, prefix: str, *options: str) -> None:
    app = make_app(f"{prefix}probe", bootstrap, 1, KafkaConfig())
    source = raw_topic(app, f"{prefix}in", f"{prefix}in2", partitions=1)
    sink = raw_topic(app, f"{prefix}out", partitions=1)
    table = app.Table("seen", default=None, partitions=1, key_type=bytes, value_type=bytes)
    consumer = app.consumer
    seek = consumer.perform_seek

    async def observed_seek() -> None:
        print(f"seek flow_control={app.flow_control.is_active()} fetching={consumer.flow_active}", flush=True)
        if "slow-seek" in options:
            await asyncio.sleep(SLOW_SEEK_S)
        await seek()

    consumer.perform_seek = observed_seek

    @app.agent(source)
    async def echo(stream):
        async for event in stream.events():
            message = event.message
            key = f"{message.topic.removeprefix(prefix)} {message.offset}".encode()
            seen = len(table.data)
            table[key] = b"1"
            await sink.send(key=key, value=key + b" %d" % seen, force=True)

    run_faust_app(app)


if __name__ == "__main__":
    main(*sys.argv[1:])
