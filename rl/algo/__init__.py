"""The algorithm math on plain tensors: advantage estimators, policy and value losses, KL
estimators and controllers, importance corrections, DAPO's sample filters, preference losses,
and the name -> function registry that config strings pick from. No Ray, DeepSpeed or I/O."""
