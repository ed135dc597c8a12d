"""The cluster model (``lmscale scaling-model``): is a data-parallel step waiting on the network?
Pure arithmetic over what was measured: ``links`` (a node's network and the intra-node link),
``collectives`` (all-reduce time of one message), ``overlap`` (what backward hides),
``step_time`` (a step on N nodes, efficiency, the table), ``measured`` (readers of calibrations,
workdirs, step profiles, sweeps), ``validation`` (against published multi-node tables)."""
