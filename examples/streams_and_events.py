"""Two streams joined by an event, timed on the device (run: python examples/streams_and_events.py
against a serving accel-emud, ACCEL_EMU_ROOT set).

A producer stream fills a buffer; a consumer stream waits for it on the device (the host
does not block) and copies it on; events time both sides with device timestamps.
"""

import numpy as np

import runtime

n = 16 << 20
producer, consumer = runtime.Stream(), runtime.Stream()
src = runtime.empty(n, np.uint8, stream=producer)
dst = runtime.empty(n, np.uint8, stream=consumer)
start, filled, done = (runtime.Event(enable_timing=True) for _ in range(3))

start.record(producer)
src.memset(0x5A, stream=producer)
filled.record(producer)
consumer.wait_event(filled)          # ordered on the device after the fill
dst.copy_(src, stream=consumer)
src.record_stream(consumer)          # src is used by consumer too: its reuse waits for it
done.record(consumer)

out = dst.copy_to_host(stream=consumer)   # pageable: returns once the data arrived
assert (out == 0x5A).all()
print(f"fill {start.elapsed_time(filled):.2f} ms, copy {filled.elapsed_time(done):.2f} ms "
      f"of device time for {n >> 20} MiB")
