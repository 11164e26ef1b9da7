"""The airline's records (flights, users, reservations), shaped as τ²-bench's airline database."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

# Field names, their order, their types (a gift card's amount is a float, a payment's an int) and their
# defaults follow τ²-bench's data model (`tau2/domains/airline/data_model.py`) on purpose: a record's
# `model_dump()` is what the reference shows the model (the JSON of a reservation or a user), and the
# database it hashes to grade a rollout, so the same dump here gives the same bytes.

FLIGHTS = "flights"  # a flight without its dates: number, airports, scheduled times
FLIGHT_DATES = "flight_dates"  # one flight on one date (`HAT001/2024-05-15`): its status, seats and prices
USERS = "users"
RESERVATIONS = "reservations"
COLLECTIONS = (FLIGHTS, FLIGHT_DATES, USERS, RESERVATIONS)

FlightType = Literal["round_trip", "one_way"]
CabinClass = Literal["business", "economy", "basic_economy"]
Insurance = Literal["yes", "no"]


class AirportCode(BaseModel):
    iata: str = Field(description="IATA code")
    city: str = Field(description="City name")


class Name(BaseModel):
    first_name: str
    last_name: str


class Address(BaseModel):
    address1: str
    address2: str | None = None
    city: str
    country: str
    state: str
    zip: str


class Payment(BaseModel):
    payment_id: str = Field(description="Unique identifier for the payment")
    amount: int = Field(description="Payment amount in dollars")


class CreditCard(BaseModel):
    source: Literal["credit_card"]
    id: str
    brand: str
    last_four: str


class GiftCard(BaseModel):
    source: Literal["gift_card"]
    id: str
    amount: float


class Certificate(BaseModel):
    source: Literal["certificate"]
    id: str
    amount: float


PaymentMethod = Annotated[CreditCard | GiftCard | Certificate, Field(discriminator="source")]


class Passenger(BaseModel):
    first_name: str = Field(description="Passenger's first name")
    last_name: str = Field(description="Passenger's last name")
    dob: str = Field(description="Date of birth in YYYY-MM-DD format")


class FlightDateStatusAvailable(BaseModel):
    status: Literal["available"]
    available_seats: dict[CabinClass, int]
    prices: dict[CabinClass, int]


class FlightDataStatusOnTime(BaseModel):
    status: Literal["on time"]
    estimated_departure_time_est: str
    estimated_arrival_time_est: str


class FlightDataStatusFlying(BaseModel):
    status: Literal["flying"]
    actual_departure_time_est: str
    estimated_arrival_time_est: str


class FlightDateStatusLanded(BaseModel):
    status: Literal["landed"]
    actual_departure_time_est: str
    actual_arrival_time_est: str


class FlightDateStatusCancelled(BaseModel):
    status: Literal["cancelled"]


class FlightDateStatusDelayed(BaseModel):
    status: Literal["delayed"]
    estimated_departure_time_est: str
    estimated_arrival_time_est: str


FlightDateStatus = Annotated[
    FlightDateStatusAvailable
    | FlightDateStatusLanded
    | FlightDateStatusCancelled
    | FlightDateStatusDelayed
    | FlightDataStatusFlying
    | FlightDataStatusOnTime,
    Field(discriminator="status"),
]


class Flight(BaseModel):
    """A flight without its dates (those are records of their own: FLIGHT_DATES)."""

    flight_number: str
    origin: str
    destination: str
    scheduled_departure_time_est: str
    scheduled_arrival_time_est: str


class FlightDate(BaseModel):
    """One entry of a flight's `dates`, validated alone."""

    date: FlightDateStatus


class DirectFlight(BaseModel):
    flight_number: str
    origin: str
    destination: str
    status: Literal["available"]
    scheduled_departure_time_est: str
    scheduled_arrival_time_est: str
    date: str | None = None
    available_seats: dict[CabinClass, int]
    prices: dict[CabinClass, int]


class ReservationFlight(BaseModel):
    flight_number: str
    origin: str
    destination: str
    date: str
    price: int


class FlightInfo(BaseModel):
    flight_number: str = Field(description="Flight number, such as 'HAT001'.")
    date: str = Field(description="The date for the flight in the format 'YYYY-MM-DD', such as '2024-05-01'.")


class User(BaseModel):
    user_id: str
    name: Name
    address: Address
    email: str
    dob: str
    payment_methods: dict[str, PaymentMethod]
    saved_passengers: list[Passenger]
    membership: Literal["gold", "silver", "regular"]
    reservations: list[str]


class Reservation(BaseModel):
    reservation_id: str
    user_id: str
    origin: str
    destination: str
    flight_type: FlightType
    cabin: CabinClass
    flights: list[ReservationFlight]
    passengers: list[Passenger]
    payment_history: list[Payment]
    created_at: str
    total_baggages: int
    nonfree_baggages: int
    insurance: Insurance
    status: Literal["cancelled"] | None = None


def flight_date_key(flight_number: str, date: str) -> str:
    """The key of one flight on one date in FLIGHT_DATES: `HAT001/2024-05-15`."""
    return f"{flight_number}/{date}"


def canonical_flight_date(record: Mapping[str, Any]) -> dict[str, Any]:
    dumped: dict[str, Any] = FlightDate.model_validate({"date": record}).model_dump()["date"]
    return dumped


_MODELS: dict[str, type[BaseModel]] = {FLIGHTS: Flight, USERS: User, RESERVATIONS: Reservation}


def canonical_record(collection: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as the reference holds it: validated by its model and dumped again."""
    if collection == FLIGHT_DATES:
        return canonical_flight_date(record)
    return _MODELS[collection].model_validate(record).model_dump()


def canonical_database(raw: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """db.json as validated records in their canonical dump, each flight's dates as records of their own.

    The reference compares databases after this same normalisation (its models' dump), so a record read
    from the file and the same record rewritten by a tool compare equal. Splitting the dates out means a
    booking writes the few flight dates whose seats it takes, not whole flights with 30 dates each.
    """
    missing = [name for name in (FLIGHTS, USERS, RESERVATIONS) if not isinstance(raw.get(name), dict)]
    if missing:
        raise ValueError(f"db.json lacks the collections {', '.join(missing)}")
    flights: dict[str, dict[str, Any]] = {}
    dates: dict[str, dict[str, Any]] = {}
    for number, flight in raw[FLIGHTS].items():
        flights[number] = canonical_record(FLIGHTS, flight)
        for date, status in flight.get("dates", {}).items():
            dates[flight_date_key(number, date)] = canonical_flight_date(status)
    return {
        FLIGHTS: flights,
        FLIGHT_DATES: dates,
        USERS: {key: canonical_record(USERS, record) for key, record in raw[USERS].items()},
        RESERVATIONS: {
            key: canonical_record(RESERVATIONS, record) for key, record in raw[RESERVATIONS].items()
        },
    }


def reference_database(collections: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The database in τ²-bench's own shape (each flight holding its `dates`), from the four collections:
    what the reference dumps and hashes. Flight dates go back to their flight in the order they come."""
    flights = {number: {**flight, "dates": {}} for number, flight in collections[FLIGHTS].items()}
    for key, status in collections[FLIGHT_DATES].items():
        number, _, date = key.partition("/")
        flights[number]["dates"][date] = status
    return {
        FLIGHTS: flights,
        USERS: dict(collections[USERS]),
        RESERVATIONS: dict(collections[RESERVATIONS]),
    }
