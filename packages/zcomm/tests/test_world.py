"""Start-up: torchrun's environment, the embedded world of one, twice is harmless, bad input."""

from __future__ import annotations

import io
import logging
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm.testing import DistributedTest


class TestFromLauncherEnvironment(DistributedTest):
    init_distributed = False  # each test starts zcomm itself, from the variables set for it

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_reads_torchrun_variables(self, world_size: int) -> None:
        assert not zcomm.is_initialized()
        zcomm.init_distributed(timeout=timedelta(seconds=60))
        assert zcomm.is_initialized()
        assert zcomm.get_rank() == int(os.environ["RANK"])
        assert zcomm.get_world_size() == world_size
        assert zcomm.get_local_rank() == int(os.environ["LOCAL_RANK"])
        assert dist.get_backend() == "gloo"  # no CUDA here: gloo is the default
        zcomm.init_distributed()  # twice is harmless
        zcomm.init_distributed("gloo")
        t = torch.ones(1)
        zcomm.all_reduce(t)
        assert t.item() == world_size

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_another_backend_keeps_the_world_up_and_says_so(self, world_size: int) -> None:
        """As DeepSpeed: a script asking for "nccl" under a launcher that started gloo (on a
        CPU machine) keeps the running world, with a warning."""
        zcomm.init_distributed(dist_backend="gloo")
        said = io.StringIO()
        handler = logging.StreamHandler(said)
        logging.getLogger("zcomm").addHandler(handler)
        try:
            zcomm.init_distributed("nccl")
            zcomm.init_distributed(dist_backend="mpi")
        finally:
            logging.getLogger("zcomm").removeHandler(handler)
        assert said.getvalue().count("already initialized with backend 'gloo'; keeping it") == 2
        assert dist.get_backend() == "gloo"
        t = torch.ones(1)
        zcomm.all_reduce(t)
        assert t.item() == world_size

    @pytest.mark.parametrize("world_size", [2])
    def test_incomplete_environment_names_the_missing_variable(self, world_size: int) -> None:
        del os.environ["MASTER_PORT"]
        with pytest.raises(ValueError, match="MASTER_PORT not set"):
            zcomm.init_distributed()
        os.environ["MASTER_PORT"] = "not-a-port"
        os.environ["RANK"] = "x"
        with pytest.raises(ValueError, match="RANK='x' is not an integer"):
            zcomm.init_distributed()


class TestMpiDiscovery(DistributedTest):
    """DeepSpeed's auto_mpi_discovery: under mpirun, rank and world size come from the MPI
    launcher's variables (the harness's torchrun variables are turned into Open MPI's or
    MPICH's here)."""

    init_distributed = False

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("launcher", ["openmpi", "mpich"])
    def test_reads_the_mpi_launchers_variables(self, world_size: int, launcher: str) -> None:
        rank = int(os.environ.pop("RANK"))
        size = os.environ.pop("WORLD_SIZE")
        port = os.environ.pop("MASTER_PORT")
        del os.environ["LOCAL_RANK"]
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
        if launcher == "mpich":
            names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
        os.environ.update(zip(names, (str(rank), size, str(rank)), strict=True))
        if world_size > 1:  # without discovery there is nothing to meet the others by
            with pytest.raises(ValueError, match="no launcher environment"):
                zcomm.init_distributed(auto_mpi_discovery=False, rank=rank, world_size=world_size)
        zcomm.init_distributed(distributed_port=int(port), rank=-1, world_size=-1)
        assert (zcomm.get_rank(), zcomm.get_world_size()) == (rank, world_size)
        assert zcomm.get_local_rank() == rank
        t = torch.ones(1)
        zcomm.all_reduce(t)
        assert t.item() == world_size

    @pytest.mark.parametrize("world_size", [2])
    def test_several_ranks_need_master_addr(self, world_size: int) -> None:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            del os.environ[name]
        os.environ.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
        with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE=2\\) without MASTER_ADDR"):
            zcomm.init_distributed()
        assert not zcomm.is_initialized()


class TestEmbeddedWorldOfOne(DistributedTest):
    world_size = 1
    init_distributed = False
    set_dist_env = False  # no launcher variables at all, as under plain `python script.py`

    def test_starts_a_world_of_one_in_process(self) -> None:
        assert "RANK" not in os.environ
        zcomm.init_distributed()
        assert (zcomm.get_rank(), zcomm.get_world_size(), zcomm.get_local_rank()) == (0, 1, 0)
        t = torch.arange(3.0)
        zcomm.all_reduce(t)
        torch.testing.assert_close(t, torch.arange(3.0))
        zcomm.barrier()
        zcomm.destroy()
        assert not zcomm.is_initialized()
        zcomm.destroy()  # harmless too

    def test_bad_arguments_name_the_argument(self) -> None:
        with pytest.raises(ValueError, match=r"timeout=\.\.\.\): must be positive"):
            zcomm.init_distributed(timeout=0)
        with pytest.raises(TypeError, match=r"timeout=\.\.\.\): expected a timedelta"):
            zcomm.init_distributed(timeout="1s")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="NCCL needs CUDA"):
            zcomm.init_distributed("nccl")
        with pytest.raises(ValueError, match="disagree"):
            zcomm.init_distributed("gloo", dist_backend="nccl")
        with pytest.raises(ValueError, match="rank and world_size are required"):
            zcomm.init_distributed(init_method="tcp://127.0.0.1:1")
        with pytest.raises(ValueError, match="rank must be in"):
            zcomm.init_distributed(init_method="tcp://127.0.0.1:1", rank=2, world_size=2)
        with pytest.raises(ValueError, match="no launcher environment"):
            zcomm.init_distributed(rank=0, world_size=2)
        not_started = r"dist_init_required=False\): torch.distributed is not initialized"
        with pytest.raises(RuntimeError, match=not_started):
            zcomm.init_distributed(dist_init_required=False)  # DeepSpeed asserts it
        assert not zcomm.is_initialized()
