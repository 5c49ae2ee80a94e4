"""The RQ workers that run finalize jobs, with a bounded wait on their command channel.

An RQ worker listens for commands (shutdown, stop a job) on a Redis pub/sub thread whose
reads wait up to 60 s. At teardown RQ unsubscribes, then stops that thread; since redis-py
8.2, `PubSubWorkerThread.stop()` joins it. When the thread has already read the unsubscribe
reply before it is told to stop, it starts another 60 s read and the join waits it out: two
in-process finalize runs of one test took 120 s that way, and a finalizer pod would outlive
its 30 s grace period and be killed. Here:

    FinalizeWorker    workers.finalizer's forking worker: its reads last 1 s, so stopping it
                      waits at most about that long
    InProcessWorker   a burst run inside this process (tests, benchmarks, the demo): no
                      command channel at all, since nothing can reach a worker that lives
                      for one burst
"""

from __future__ import annotations

from rq import SimpleWorker, Worker

COMMAND_READ_SECONDS = 1.0  # the longest a stopping worker waits on its command thread


class FinalizeWorker(Worker):
    def subscribe(self) -> None:
        """RQ's subscribe, with reads of COMMAND_READ_SECONDS instead of 60 s."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=COMMAND_READ_SECONDS, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)


class InProcessWorker(SimpleWorker):
    def subscribe(self) -> None:
        """No command channel: RQ's teardown skips the unsubscribe when there is no thread."""
