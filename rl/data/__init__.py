"""The data of a step: prompt tables read from files, multi-turn episodes and the environment
API they run against, the tool-call format, and the typed records passed between the stages
(samples, scored batches, the learner's padded `TrainBatch`)."""
