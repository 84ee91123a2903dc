"""One cluster = one job: its ranks, their torch.distributed world and the FSDP2 sharding of one replica."""
