"""An in-process Flower Grid: the fedhet ServerApp and ClientApp talking through Flower's message types in one
process, without SuperLink, SuperNodes or Ray.

Every message, reply and node ``Context.state`` goes through Flower's wire encoding (deflate to bytes, inflate back)
as it would between machines, so this checks the whole Flower path (records, node discovery, client state on the
node, error replies) in milliseconds. Used by the tests, and handy to debug an app before deploying it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

SUPERLINK_NODE_ID = 1  # flwr.common.constant.SUPERLINK_NODE_ID: the sender id of the server's messages


def over_the_wire(obj: Any) -> Any:
    """``obj`` (a Message or RecordDict) encoded to bytes and decoded again, as Flower ships it."""
    contents = {oid: o.deflate() for oid, o in get_all_nested_objects(obj).items()}
    return inflate_object_from_contents(obj.object_id, contents)


class LoopbackGrid(Grid):
    """Nodes ``{node_id: node_config}`` that each run ``client_app`` on the messages sent to them."""

    def __init__(
        self, client_app: ClientApp, node_configs: dict[int, dict[str, Any]], run_config: dict | None = None
    ) -> None:
        self.client_app = client_app
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config=dict(nc), state=RecordDict(), run_config=run_config or {})
            for nid, nc in node_configs.items()
        }
        self.replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=1)
        # Messages are stamped with the identity of the process's task; Flower sets it when it starts a ServerApp.
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg_id = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = msg_id
            ids.append(msg_id)
            self.replies[msg_id] = self.deliver(msg)
        return ids

    def deliver(self, msg: Message) -> Message:
        """Run the node's ClientApp on the message as received over the wire; keep the node state it leaves."""
        received = over_the_wire(msg)
        received.metadata.__dict__["_message_id"] = msg.metadata.message_id
        context = self.contexts[msg.metadata.dst_node_id]
        reply = self.client_app(received, context)
        context.state = over_the_wire(context.state)  # the SuperNode stores the context between messages
        out = over_the_wire(reply)
        out.metadata.__dict__["_reply_to_message_id"] = msg.metadata.message_id
        return out

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
