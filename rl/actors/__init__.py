"""Actor plumbing, the bottom layer every group of actors stands on: `group.ActorGroup` (N actors
made alike: start, calls with deadlines, restarts, placement) and `faults` (fan-out with a
deadline on every wait, and how a failure is classified and named). Ray is passed in, never
imported here; rollout/, trainer/, reward/ and sandbox/ use these, not the loop's stages."""
