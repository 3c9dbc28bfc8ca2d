"""The Faust app: agents that turn raw record batches into ClickHouse tables and derived topics."""
