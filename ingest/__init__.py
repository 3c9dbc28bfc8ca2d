"""What produces records: the record contract, tracers, host agent, importers and the simulator."""
