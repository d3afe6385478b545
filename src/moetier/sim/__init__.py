"""The discrete-event simulator: a machine model on simpy that replays routing traces through
the same policies/ code as the engine (cache, prefetch, schedule). No torch, no store/runtime."""
