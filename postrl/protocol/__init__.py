"""Batch container shared by every stage (``DataProto``)."""

from postrl.protocol.data import DataProto, DataProtoError

__all__ = ["DataProto", "DataProtoError"]
