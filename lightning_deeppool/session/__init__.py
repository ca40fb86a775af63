"""What both front doors (the Trainer's strategy and Fabric's) share: the plan's state on a rank for
one training run (`PlanSession`), the takeover of the planned module's forward calls (`ForwardCalls`),
where the ranks meet (`CallAgreement`), step times, DDP's options, and what they do to the user's
module with torch alone. Nothing here imports Lightning."""
