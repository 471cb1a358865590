"""kvroute's pure core: block keys, the prefix index, vLLM wire structs, statistics, the trace
recorder and the routing core. No I/O; the router (async shell) and the simulator (virtual clock)
both drive it. Imports nothing from router/, sim/ or loadtest/."""
