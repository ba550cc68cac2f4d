"""How fast a run will be: the speed book (what this machine measured), the speed model from a run's
parts (GPU FLOPs, PCIe copies, the host step), and the cards it can predict."""
