"""A stage-shaped faust app for tests/streams/test_recovery.py, built by the stages' own
``make_app``: it records every event of ``<prefix>in`` in a table and echoes its offset to
``<prefix>out``. Before each seek faust makes, it prints whether the fetcher and the agents'
queues were running (the seek must find them stopped, or events fetched during it are lost).

Usage: ``python -m tests.streams.recovery_probe BOOTSTRAP PREFIX``
"""

from __future__ import annotations

import sys

from rollstream.app.stages import run_faust_app
from rollstream.config.base import KafkaConfig
from rollstream.streams.common import make_app, raw_topic


def main(bootstrap: str, prefix: str) -> None:
    app = make_app(f"{prefix}probe", bootstrap, 1, KafkaConfig())
    source, sink = raw_topic(app, f"{prefix}in", partitions=1), raw_topic(app, f"{prefix}out", partitions=1)
    table = app.Table("seen", default=None, partitions=1, key_type=bytes, value_type=bytes)
    consumer = app.consumer
    seek = consumer.perform_seek

    async def observed_seek() -> None:
        print(f"seek flow_control={app.flow_control.is_active()} fetching={consumer.flow_active}", flush=True)
        await seek()

    consumer.perform_seek = observed_seek

    @app.agent(source)
    async def echo(stream):
        async for event in stream.events():
            offset = str(event.message.offset).encode()
            table[offset] = b"1"
            await sink.send(key=offset, value=offset, force=True)

    run_faust_app(app)


if __name__ == "__main__":
    main(*sys.argv[1:3])
