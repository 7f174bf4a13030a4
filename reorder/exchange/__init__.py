"""The exchange: the collectives interface (emulated and torch.distributed) and the window driver,
the only code that calls collectives."""

from reorder.exchange.collectives import CollectiveError, Collectives, EmulatedGroup, run_emulated
from reorder.exchange.exchanger import WindowExchanger
from reorder.exchange.executors import TorchExecutor, select_executor
from reorder.exchange.placement import Placement, place
from reorder.exchange.round import Outgoing, ReorderError, WindowReport, WindowRound

__all__ = ["CollectiveError", "Collectives", "EmulatedGroup", "Outgoing", "Placement", "ReorderError", "TorchExecutor",
           "WindowExchanger", "WindowReport", "WindowRound", "place", "run_emulated", "select_executor"]
