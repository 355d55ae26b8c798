"""``NatsJetStreamBroker``: the JetStream publisher that also makes the consumers of
``@outbox.subscriber``, both on one connection (the composition of ``publisher`` and
``consumer``, which never import each other)."""

from __future__ import annotations

from fastapi_outbox.brokers.consumer import ConsumerConfig
from fastapi_outbox.brokers.nats.consumer import NatsJetStreamConsumer
from fastapi_outbox.brokers.nats.publisher import NatsJetStreamPublisher

__all__ = ["NatsJetStreamBroker"]


class NatsJetStreamBroker(NatsJetStreamPublisher):
    """Publishes to JetStream with ``Nats-Msg-Id`` de-duplication, and consumes with
    durable pull consumers (:meth:`consumer`)."""

    def consumer(self, config: ConsumerConfig) -> NatsJetStreamConsumer:
        """The consumer side of ``@outbox.subscriber`` (``consumer.py``)."""
        return NatsJetStreamConsumer(self, config)
