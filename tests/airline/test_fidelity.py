"""The airline tools against τ²-bench's own environment, run from the wheel: schemas, outputs to the byte,
the final database, for every task's gold actions and for calls that reach every error of the reference."""

from __future__ import annotations

from typing import Any

import pytest

from tests.airline import corpus, reference
from tools.airline import pack
from tools.airline.tasks import ToolCall


def test_the_tools_are_the_references_names_descriptions_and_parameters() -> None:
    tools = {tool.name: tool.openai_schema["function"] for tool in reference.environment().get_tools()}
    mine = {name: spec.function_tool()["function"] for name, spec in pack.tools.items()}
    assert list(mine) == list(tools)  # the reference's order too
    for name, theirs in tools.items():
        ours = mine[name]
        assert ours["description"] == theirs["description"], name
        wanted, served = theirs["parameters"], ours["parameters"]
        assert list(served["properties"]) == list(wanted["properties"]), name
        assert sorted(served.get("required", [])) == sorted(wanted.get("required", [])), name
        for parameter, schema in wanted["properties"].items():
            assert served["properties"][parameter].get("description") == schema.get("description"), parameter
            assert served["properties"][parameter].get("enum") == schema.get("enum"), parameter
        assert sorted(served.get("$defs", {})) == sorted(wanted.get("$defs", {})), name
        for model, schema in wanted.get("$defs", {}).items():
            fields = {key: value.get("description") for key, value in schema["properties"].items()}
            assert {
                k: v.get("description") for k, v in served["$defs"][model]["properties"].items()
            } == fields


TASKS = 50  # τ²-bench airline: train 30 + test 20 (the data is fetched after collection, by the fixture)


def test_the_corpus_has_every_task() -> None:
    assert sorted(corpus.load_tasks(), key=int) == [str(n) for n in range(TASKS)]


@pytest.mark.slow
@pytest.mark.parametrize("task_id", [str(n) for n in range(TASKS)])
def test_every_tasks_gold_actions_give_the_references_outputs_and_database(task_id: str) -> None:
    calls = corpus.gold_calls(task_id)
    result = corpus.replay(calls)
    theirs = reference.run(calls)
    assert corpus.outputs(result) == theirs.outputs
    assert corpus.database_text(result.changes) == theirs.database


def _price(raw: dict[str, Any], flight: str, date: str, cabin: str) -> int:
    price: int = raw["flights"][flight]["dates"][date]["prices"][cabin]
    return price


def edge_calls() -> list[ToolCall]:
    """Calls through every branch of the reference: its errors, its quirks, its id lists running out."""
    raw = corpus.raw_db()
    user = "mei_hernandez_8984"  # a gift card (98), two certificates (250 each), two credit cards
    economy = _price(raw, "HAT001", "2024-05-20", "economy")
    # The same flight twice (the reference takes its seats twice), insurance, one paid bag.
    total = 2 * economy + 30 + 50
    booked = {
        "user_id": user,
        "origin": "PHL",
        "destination": "LGA",
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": "HAT001", "date": "2024-05-20"}] * 2,
        "passengers": [{"first_name": "Mei", "last_name": "Hernandez", "dob": "1981-01-04"}],
        "total_baggages": 2,
        "nonfree_baggages": 1,
        "insurance": "yes",
    }
    certificate = min(250, total)
    gift = min(98, total - certificate)
    paid = [
        {"payment_id": "certificate_7502997", "amount": certificate},
        {"payment_id": "gift_card_5309492", "amount": gift},
        {"payment_id": "credit_card_2140654", "amount": total - certificate - gift},
    ]
    basic = _price(raw, "HAT001", "2024-05-21", "basic_economy")
    cheap = {
        **booked,
        "cabin": "basic_economy",
        "flights": [{"flight_number": "HAT001", "date": "2024-05-21"}],
        "insurance": "no",
        "nonfree_baggages": 0,
        "payment_methods": [{"payment_id": "credit_card_6082923", "amount": basic}],
    }
    return [
        ("get_user_details", {"user_id": "nobody_0000"}),
        ("get_reservation_details", {"reservation_id": "NOPE00"}),
        ("get_flight_status", {"flight_number": "HAT001", "date": "2024-05-01"}),
        ("get_flight_status", {"flight_number": "HAT999", "date": "2024-05-01"}),
        ("get_flight_status", {"flight_number": "HAT001", "date": "2024-06-01"}),
        ("list_all_airports", {}),
        ("search_direct_flight", {"origin": "PHL", "destination": "LGA", "date": "2024-05-20"}),
        ("search_onestop_flight", {"origin": "LGA", "destination": "SEA", "date": "2024-05-20"}),
        ("search_onestop_flight", {"origin": "LGA", "destination": "SEA", "date": "2024-05-29"}),
        ("search_onestop_flight", {"origin": "LGA", "destination": "SEA", "date": "2024-05-30"}),
        ("calculate", {"expression": "2 + 2"}),
        ("calculate", {"expression": "10 / 3"}),
        ("calculate", {"expression": "abc"}),
        ("book_reservation", {**booked, "payment_methods": [{**paid[0], "amount": total}]}),
        (
            "book_reservation",
            {
                **booked,
                "flights": [{"flight_number": "HAT001", "date": "2024-05-01"}],
                "payment_methods": paid,
            },
        ),
        ("book_reservation", {**booked, "payment_methods": [{**paid[2], "amount": total - 1}]}),
        ("book_reservation", {**booked, "payment_methods": [{"payment_id": "nope", "amount": total}]}),
        ("book_reservation", {**booked, "user_id": "nobody_0000", "payment_methods": paid}),
        ("book_reservation", {**booked, "payment_methods": paid}),
        ("book_reservation", cheap),
        ("book_reservation", cheap),
        ("book_reservation", cheap),
        ("send_certificate", {"user_id": user, "amount": 150}),
        ("send_certificate", {"user_id": user, "amount": 100}),
        ("send_certificate", {"user_id": user, "amount": 50}),
        ("send_certificate", {"user_id": user, "amount": 50}),
        ("send_certificate", {"user_id": "nobody_0000", "amount": 50}),
        ("update_reservation_baggages", _bags("R9QDGB", 2, 2, "gift_card_5309492")),
        ("update_reservation_baggages", _bags("R9QDGB", 2, 2, "certificate_3321326")),
        ("update_reservation_baggages", _bags("R9QDGB", 2, 2, "nope")),
        ("update_reservation_baggages", _bags("R9QDGB", 2, 2, "credit_card_2140654")),
        ("update_reservation_baggages", _bags("R9QDGB", 1, 1, "credit_card_2140654")),
        ("update_reservation_baggages", _bags("NOPE00", 1, 1, "credit_card_2140654")),
        ("update_reservation_flights", _flights("07S7FC", "economy", [("HAT286", "2024-05-28")])),
        (
            "update_reservation_flights",
            _flights("07S7FC", "economy", [("HAT286", "2024-05-28"), ("HAT175", "2024-05-29")]),
        ),
        ("update_reservation_flights", _flights("07S7FC", "economy", [("HAT001", "2024-05-01")])),
        ("update_reservation_flights", _flights("07S7FC", "business", [("HAT999", "2024-05-28")])),
        (
            "update_reservation_passengers",
            {"reservation_id": "R9QDGB", "passengers": [booked["passengers"][0]]},
        ),
        (
            "update_reservation_passengers",
            {"reservation_id": "R9QDGB", "passengers": [booked["passengers"][0]] * 3},
        ),
        ("cancel_reservation", {"reservation_id": "79G8A9"}),
        ("cancel_reservation", {"reservation_id": "79G8A9"}),
        ("cancel_reservation", {"reservation_id": "NOPE00"}),
        ("transfer_to_human_agents", {"summary": "wants a refund"}),
        ("get_user_details", {"user_id": user}),
        ("get_reservation_details", {"reservation_id": "HATHAT"}),
    ]


def _bags(reservation: str, total: int, nonfree: int, payment: str) -> dict[str, Any]:
    return {
        "reservation_id": reservation,
        "total_baggages": total,
        "nonfree_baggages": nonfree,
        "payment_id": payment,
    }


def _flights(reservation: str, cabin: str, flights: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "reservation_id": reservation,
        "cabin": cabin,
        "flights": [{"flight_number": number, "date": date} for number, date in flights],
        "payment_id": "gift_card_5309492",
    }


def test_calls_through_every_branch_give_the_references_outputs_and_database() -> None:
    calls = edge_calls()
    result = corpus.replay(calls)
    theirs = reference.run(calls)
    ours = corpus.outputs(result)
    for index, (call, mine, wanted) in enumerate(zip(calls, ours, theirs.outputs, strict=True)):
        assert mine == wanted, (index, call)
    assert corpus.database_text(result.changes) == theirs.database
    # The calls reach what they were written for: errors, the last free ids, and the ids running out.
    errors = [output for output in ours if output.startswith("Error: ")]
    assert len(errors) >= 15
    assert "Error: Too many reservations" in ours and "Error: Too many certificates" in ours
    assert any("certificate_3221324" in output for output in ours)
    assert any('"reservation_id": "HATHAV"' in output for output in ours)
    assert '"date": "2024-05-21"' in ours[7]  # a connection the day after a flight that lands after midnight
