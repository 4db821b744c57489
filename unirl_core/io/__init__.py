"""SampleBatch <-> Arrow: versioned schema, bit-exact tensor columns, zero-copy IPC reads."""

from unirl_core.io.arrow import batch_to_table, table_to_batch
from unirl_core.io.ipc import read_batch, write_batch
from unirl_core.io.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "batch_to_table", "read_batch", "table_to_batch", "write_batch"]
